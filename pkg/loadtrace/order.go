package loadtrace

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// orderFile is the name of the persisted orders in the state directory.
const orderFile = "orders.json"

// maxOrderFileBytes bounds what is read back of the persisted orders.
const maxOrderFileBytes = 64 << 20

// orderStore keeps the first-read order of each model's files, the last
// recorded per "org/name@rev", at most max models of at most maxFiles
// files; persisted whole, atomically, on each change.
type orderStore struct {
	path     string // "" keeps them in memory
	max      int
	maxFiles int

	mu sync.Mutex
	m  map[string]orderEntry
}

type orderEntry struct {
	Updated time.Time `json:"updated"`
	Files   []string  `json:"files"`
}

type orderDoc struct {
	Version int                   `json:"version"`
	Models  map[string]orderEntry `json:"models"`
}

func newOrderStore(dir string, maxModels, maxFiles int, log *slog.Logger) *orderStore {
	s := &orderStore{max: maxModels, maxFiles: maxFiles, m: make(map[string]orderEntry)}
	if dir == "" {
		return s
	}
	s.path = filepath.Join(dir, orderFile)
	b, err := readBounded(s.path)
	if errors.Is(err, fs.ErrNotExist) {
		return s
	}
	if err == nil {
		s.m, err = decodeOrders(b, maxModels, maxFiles)
	}
	if err != nil {
		log.Warn("reading recorded model file orders; starting without", "path", s.path, "err", err)
		s.m = make(map[string]orderEntry)
	}
	return s
}

func readBounded(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxOrderFileBytes+1))
	if err == nil && len(b) > maxOrderFileBytes {
		err = fmt.Errorf("larger than %d bytes", maxOrderFileBytes)
	}
	return b, err
}

// decodeOrders parses a persisted order file, keeping the valid entries
// within the bounds (the newest models, the first files).
func decodeOrders(b []byte, maxModels, maxFiles int) (map[string]orderEntry, error) {
	var doc orderDoc
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("decoding model file orders: %w", err)
	}
	if doc.Version != 1 {
		return nil, fmt.Errorf("decoding model file orders: version %d, want 1", doc.Version)
	}
	m := make(map[string]orderEntry, min(len(doc.Models), maxModels))
	for model, e := range doc.Models {
		name, rev, ok := strings.Cut(model, "@")
		if !ok || rev == "" || content.ValidateModelName(name) != nil {
			continue
		}
		files := slices.DeleteFunc(e.Files, func(f string) bool { return !validFile(f) })
		if len(files) == 0 {
			continue
		}
		m[model] = orderEntry{Updated: e.Updated, Files: files[:min(len(files), maxFiles)]}
	}
	for len(m) > maxModels {
		delete(m, oldest(m))
	}
	return m, nil
}

// validFile accepts a clean, relative, slash-separated path.
func validFile(f string) bool {
	return f != "" && !path.IsAbs(f) && path.Clean(f) == f && f != ".." && !strings.HasPrefix(f, "../")
}

func oldest(m map[string]orderEntry) string {
	var key string
	var at time.Time
	for k, e := range m {
		if key == "" || e.Updated.Before(at) || (e.Updated.Equal(at) && k < key) {
			key, at = k, e.Updated
		}
	}
	return key
}

// get returns the order of model, "org/name@rev" exactly or, failing that,
// the latest recorded revision of its name.
func (s *orderStore) get(model string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.m[model]; ok {
		return slices.Clone(e.Files)
	}
	name := model
	if i := strings.LastIndexByte(model, '@'); i >= 0 {
		name = model[:i]
	}
	var best orderEntry
	for k, e := range s.m {
		if strings.HasPrefix(k, name+"@") && !strings.Contains(k[len(name)+1:], "@") && e.Updated.After(best.Updated) {
			best = e
		}
	}
	return slices.Clone(best.Files)
}

// set records model's order and persists the store.
func (s *orderStore) set(model string, files []string, at time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[model] = orderEntry{Updated: at, Files: slices.Clone(files[:min(len(files), s.maxFiles)])}
	for len(s.m) > s.max {
		delete(s.m, oldest(s.m))
	}
	if s.path == "" {
		return nil
	}
	b, err := json.Marshal(orderDoc{Version: 1, Models: s.m})
	if err != nil {
		return fmt.Errorf("encoding model file orders: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o755); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	if err := cache.WriteFileAtomic(s.path, b, 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", s.path, err)
	}
	return nil
}
