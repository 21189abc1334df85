package mirror

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// Bounds of the mirror's memory.
const (
	maxTags       = 4096    // tag mappings kept; the least recently updated go first
	maxKnownBlobs = 1 << 16 // remembered blob sizes, first in first out
)

// tagsFile is the name of the tag mappings under the state directory.
const tagsFile = "mirror-tags.json"

// tagEntry is what a tag last pointed at.
type tagEntry struct {
	Digest    digest.Digest `json:"digest"`
	MediaType string        `json:"mediaType"`
	Updated   time.Time     `json:"updated"`
	// Public says the registry gave the manifest without credentials: it
	// may be served from the cache to anyone while the registry is down.
	Public bool `json:"public,omitempty"`
}

// tagKey names a tag: registry/repository:tag, every part validated.
func tagKey(registry, repository, tag string) string {
	return registry + "/" + repository + ":" + tag
}

// validTagKey checks a key read back from disk.
func validTagKey(k string) bool {
	name, tag, ok := cutLast(k, ":")
	if !ok || !tagRE.MatchString(tag) {
		return false
	}
	registry, repo, ok := strings.Cut(name, "/")
	if !ok {
		return false
	}
	if _, ok := canonicalHost(registry); !ok {
		return false
	}
	return validateRepository(repo) == nil
}

func cutLast(s, sep string) (before, after string, found bool) {
	i := strings.LastIndex(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+len(sep):], true
}

// tagStore is the tag → manifest map, persisted (atomically) when it has a
// path.
type tagStore struct {
	path string // "" keeps it in memory
	mu   sync.Mutex
	m    map[string]tagEntry
}

// openTagStore loads the tag mappings from dir ("" for memory only). An
// unreadable or corrupt file is set aside, not fatal: tags are a cache.
func openTagStore(dir string) (*tagStore, error) {
	t := &tagStore{m: make(map[string]tagEntry)}
	if dir == "" {
		return t, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating mirror state directory: %w", err)
	}
	t.path = filepath.Join(dir, tagsFile)
	b, err := os.ReadFile(t.path)
	if errors.Is(err, os.ErrNotExist) {
		return t, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading mirror tags: %w", err)
	}
	var m map[string]tagEntry
	if err := json.Unmarshal(b, &m); err != nil {
		// Keep the bad file for a person to look at; start afresh.
		if rerr := os.Rename(t.path, t.path+".corrupt"); rerr != nil {
			return nil, fmt.Errorf("mirror tags %s are corrupt (%v) and cannot be set aside: %w", t.path, err, rerr)
		}
		return t, nil
	}
	for k, e := range m {
		if validTagKey(k) && content.ValidateDigest(e.Digest) == nil && mediaTypeRE.MatchString(e.MediaType) {
			t.m[k] = e
		}
	}
	return t, nil
}

func (t *tagStore) get(key string) (tagEntry, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.m[key]
	return e, ok
}

// put records a tag; the file is rewritten only when the tag moved.
func (t *tagStore) put(key string, e tagEntry) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	old, ok := t.m[key]
	t.m[key] = e
	if ok && old.Digest == e.Digest && old.MediaType == e.MediaType && old.Public == e.Public {
		return nil
	}
	for len(t.m) > maxTags {
		var oldest string
		for k, v := range t.m {
			if oldest == "" || v.Updated.Before(t.m[oldest].Updated) {
				oldest = k
			}
		}
		delete(t.m, oldest)
	}
	if t.path == "" {
		return nil
	}
	b, err := json.Marshal(t.m)
	if err != nil {
		return err
	}
	return cache.WriteFileAtomic(t.path, b, 0o644)
}

// knownBlob is what a manifest said of a blob.
type knownBlob struct {
	Size      int64
	MediaType string // "" when unknown
}

// knownBlobs remembers the sizes and media types of the blobs that
// manifests name, bounded, first in first out.
type knownBlobs struct {
	mu    sync.Mutex
	max   int
	m     map[digest.Digest]knownBlob
	order []digest.Digest
}

func newKnownBlobs(max int) *knownBlobs {
	return &knownBlobs{max: max, m: make(map[digest.Digest]knownBlob)}
}

func (k *knownBlobs) put(d digest.Digest, b knownBlob) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if old, ok := k.m[d]; ok {
		if b.MediaType == "" {
			b.MediaType = old.MediaType
		}
		k.m[d] = b
		return
	}
	k.m[d] = b
	k.order = append(k.order, d)
	for len(k.order) > k.max {
		delete(k.m, k.order[0])
		k.order = k.order[1:]
	}
}

func (k *knownBlobs) get(d digest.Digest) (knownBlob, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	b, ok := k.m[d]
	return b, ok
}

func (k *knownBlobs) forget(d digest.Digest) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, d) // its place in order is dropped when it comes up
}
