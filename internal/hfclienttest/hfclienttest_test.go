package hfclienttest_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hfclienttest"
	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

func contentBytes(t *testing.T, c hubtest.Content) []byte {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(c, 0, c.Size()))
	require.NoError(t, err)
	return b
}

// weightd fetches models from a hub (internal/hubtest) the way the agent
// does, through its prefetch queue into its cache; then the hub's official
// JavaScript client reads that cache offline with its own code, as a loader
// on the node would: it must find the model by name and the branch "main"
// (through refs/main) at the commit the hub named, and read through the
// snapshot the bytes the hub served. See offline.cjs for exactly which
// functions of the library are called and what each one checks.
func TestHubJSReadsTheCache(t *testing.T) {
	t.Parallel()
	moduleDir := hfclienttest.Require(t)

	hub := hubtest.New()
	t.Cleanup(hub.Close)
	v1 := map[string]hubtest.Content{
		".gitattributes":           hubtest.String("*.safetensors filter=lfs diff=lfs merge=lfs -text\n"),
		"config.json":              hubtest.String(`{"model_type": "llama"}`),
		"generation_config.json":   hubtest.String(`{"model_type": "llama"}`), // same bytes: one blob
		"model.safetensors":        hubtest.Generated(300_000, 1),
		"tokenizer/tokenizer.json": hubtest.String(`{"version": "1.0"}`),
		"sub dir/weights #1.bin":   hubtest.Generated(70_000, 2),
	}
	v2 := map[string]hubtest.Content{
		"config.json":              hubtest.String(`{"model_type": "mistral"}`),
		"model.safetensors":        hubtest.Generated(200_000, 3),
		"tokenizer/tokenizer.json": hubtest.String(`{"version": "2.0"}`),
	}
	repo := hub.AddRepo("org/model", v1)
	first := repo.Resolve("main")
	repo.Tag("v1.0", first)
	pinnedRepo := hub.AddRepo("org/pinned", map[string]hubtest.Content{"config.json": hubtest.String(`{}`)})
	pinned := pinnedRepo.Resolve("main")

	// The agent's path: a hub source, the prefetch queue, the cache.
	root := t.TempDir()
	store, err := cache.Open(root)
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	src, err := hf.New(nil, hf.WithEndpoint(hub.URL))
	require.NoError(t, err)
	q := prefetch.NewQueue(store, source.Sources{ref.KindHF: src})
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { q.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	fetch := func(ref string) string {
		t.Helper()
		j, err := q.Submit(ref, prefetch.PriorityNormal)
		require.NoError(t, err)
		st, err := j.Wait(ctx)
		require.NoError(t, err, ref)
		require.Equal(t, prefetch.StateReady, st.State, ref)
		return st.Dir
	}
	fetch("hf://org/model@main")
	fetch("hf://org/model@v1.0")
	second := repo.Commit("main", "second", v2) // main moves on
	dir := fetch("hf://org/model@main")
	fetch("hf://org/pinned@" + pinned)
	models := filepath.Join(root, "models")
	require.Equal(t, filepath.Join(models, "models--org--model", "snapshots", second), dir)

	for _, tc := range []struct {
		revision, commit string
		files            map[string]hubtest.Content
	}{
		{"main", second, v2},
		{"v1.0", first, v1},
	} {
		var paths []string
		for p := range tc.files {
			paths = append(paths, p)
		}
		slices.Sort(paths)
		c, err := hfclienttest.ReadCache(t.Context(), moduleDir, models, "org/model", tc.revision, paths...)
		require.NoError(t, err)
		assert.Equal(t, models, c.CacheDir, "the library takes the cache from HF_HUB_CACHE")
		assert.Empty(t, c.Warnings, "scanCacheDir could not read a repository")
		assert.Empty(t, c.NetworkAttempts, "the library tried to reach the hub")

		// By name and ref, at the commit the hub named.
		require.NotNil(t, c.Resolved, "no revision of org/model has the ref %q: %+v", tc.revision, c.Repos)
		assert.Equal(t, tc.commit, c.Resolved.Commit, tc.revision)
		snapshot := filepath.Join(models, "models--org--model", "snapshots", tc.commit)
		assert.Equal(t, snapshot, c.Resolved.Snapshot)
		require.Len(t, c.Resolved.Files, len(paths))
		for _, f := range c.Resolved.Files {
			assert.Equal(t, filepath.Join(snapshot, filepath.FromSlash(f.Path)), f.Pointer, f.Path)
			assert.Equal(t, contentBytes(t, tc.files[f.Path]), f.Content, "%s@%s: %s", "org/model", tc.revision, f.Path)
		}
	}

	// Every repository and revision, with the refs that name it and the
	// blobs its files link to (weightd's shared blobs/sha256/<hex>).
	c, err := hfclienttest.ReadCache(t.Context(), moduleDir, models, "org/model", "main")
	require.NoError(t, err)
	assert.Empty(t, c.Warnings)
	type rev struct {
		Refs  []string
		Files map[string]int64 // top-level file → size
	}
	got := map[string]map[string]rev{} // repo → commit → refs and files
	for _, r := range c.Repos {
		assert.Equal(t, "model", r.Type, r.Name)
		got[r.Name] = map[string]rev{}
		for _, v := range r.Revisions {
			files := map[string]int64{}
			for _, f := range v.Files {
				rel, err := filepath.Rel(v.Path, f.Path)
				require.NoError(t, err)
				files[rel] = f.Size
				sum := sha256.Sum256(mustRead(t, f.Path))
				assert.Equal(t, filepath.Join(root, "blobs", "sha256", hex.EncodeToString(sum[:])), f.Blob, "the blob of %s", f.Path)
			}
			got[r.Name][v.Commit] = rev{Refs: v.Refs, Files: files}
		}
	}
	topLevel := func(files map[string]hubtest.Content) map[string]int64 {
		m := map[string]int64{}
		for p, c := range files {
			if filepath.Dir(p) == "." {
				m[p] = c.Size()
			}
		}
		return m
	}
	assert.Equal(t, map[string]map[string]rev{
		"org/model": {
			first:  {Refs: []string{"v1.0"}, Files: topLevel(v1)},
			second: {Refs: []string{"main"}, Files: topLevel(v2)},
		},
		"org/pinned": {
			pinned: {Refs: []string{}, Files: map[string]int64{"config.json": 2}},
		},
	}, got)
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return b
}
