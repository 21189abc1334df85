package hf_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// hfSource returns a source for hub.
func hfSource(t *testing.T, endpoint string, opts ...hf.Option) *hf.Source {
	t.Helper()
	src, err := hf.New(nil, append([]hf.Option{hf.WithEndpoint(endpoint), hf.WithVersion("test")}, opts...)...)
	require.NoError(t, err)
	return src
}

func hfResolve(t *testing.T, src *hf.Source, reference string) (*source.Resolution, error) {
	t.Helper()
	r, err := ref.Parse(reference)
	require.NoError(t, err)
	return src.Resolve(t.Context(), r)
}

// hfStore opens a store that retries quickly.
func hfStore(t *testing.T) *cache.Store {
	t.Helper()
	s, err := cache.Open(t.TempDir(), cache.WithRetries(5, time.Millisecond), cache.WithChunkSize(1<<20))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// hfFetch fetches every file of res into store and materialises the model.
func hfFetch(t *testing.T, store *cache.Store, res *source.Resolution) (string, error) {
	t.Helper()
	for _, f := range res.Model.Files {
		if _, err := store.Fetch(t.Context(), f.Descriptor, res.Blobs[f.Digest], nil); err != nil {
			return "", err
		}
	}
	if res.Verify != nil {
		if err := res.Verify(store.Open); err != nil {
			return "", err
		}
	}
	return store.Materialize(res.Model)
}

func contentBytes(t *testing.T, c hubtest.Content) []byte {
	t.Helper()
	b, err := io.ReadAll(io.NewSectionReader(c, 0, c.Size()))
	require.NoError(t, err)
	return b
}

// checkDir checks that dir holds exactly files.
func checkDir(t *testing.T, dir string, files map[string]hubtest.Content) {
	t.Helper()
	n := 0
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		c, ok := files[filepath.ToSlash(rel)]
		if assert.True(t, ok, "unexpected file %s", rel) {
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			assert.True(t, bytes.Equal(contentBytes(t, c), got), "content of %s", rel)
		}
		n++
		return nil
	}))
	assert.Equal(t, len(files), n)
}

func modelFiles() map[string]hubtest.Content {
	return map[string]hubtest.Content{
		".gitattributes":                        hubtest.String("*.safetensors filter=lfs diff=lfs merge=lfs -text\n"),
		"config.json":                           hubtest.String(`{"model_type": "llama"}`),
		"generation_config.json":                hubtest.String(`{"model_type": "llama"}`), // same bytes: one blob
		"tokenizer.json":                        hubtest.Generated(200_000, 3),
		"model-00001-of-00002.safetensors":      hubtest.Generated(3<<20+17, 1),
		"model-00002-of-00002.safetensors":      hubtest.Generated(1<<20, 2),
		"copy/model-00002-of-00002.safetensors": hubtest.Generated(1<<20, 2), // same bytes: one blob
		"sub dir/weights #1.bin":                hubtest.Generated(100_000, 4),
		"empty.txt":                             hubtest.String(""),
	}
}

func TestResolveFetchMaterialize(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithPageSize(3))
	t.Cleanup(hub.Close)
	files := modelFiles()
	repo := hub.AddRepo("org/model", files)
	commit := repo.Resolve("main")

	res, err := hfResolve(t, hfSource(t, hub.URL), "hf://org/model")
	require.NoError(t, err)
	assert.Equal(t, "org/model", res.Model.Name)
	assert.Equal(t, commit, res.Model.Revision)
	require.Len(t, res.Model.Files, len(files))
	for _, f := range res.Model.Files {
		assert.Equal(t, files[f.Path].Size(), f.Size, f.Path)
		assert.Contains(t, res.Blobs, f.Digest)
	}
	assert.Len(t, res.Blobs, len(files)-2, "identical files share a blob")
	lfs := hub.SHA256("org/model", "main", "model-00001-of-00002.safetensors")
	assert.Contains(t, res.Blobs, digest.NewDigestFromEncoded(digest.SHA256, lfs), "LFS files are known by their sha256")

	store := hfStore(t)
	dir, err := hfFetch(t, store, res)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(store.Root(), "models", "models--org--model", "snapshots", commit), dir)
	checkDir(t, dir, files)

	st := hub.Stats()
	assert.Equal(t, int64(3<<20+17+1<<20+100_000), st.CDNBytes, "each LFS blob read once, from the CDN")
	assert.Equal(t, int64(4), st.Requests[hubtest.RouteTree], "9 files and 2 directories, 3 a page")
	assert.Equal(t, int64(1), st.Requests[hubtest.RouteInfo])
}

func TestRevisions(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	v := func(s string) map[string]hubtest.Content {
		return map[string]hubtest.Content{"config.json": hubtest.String(s), "model.safetensors": hubtest.String("weights " + s)}
	}
	repo := hub.AddRepo("org/model", v("main"))
	first := repo.Resolve("main")
	dev := repo.Commit("dev", "dev", v("dev"))
	pr := repo.Commit("refs/pr/1", "a pull request", v("pr"))
	tagged := repo.Commit("main", "second", v("tagged"))
	repo.Tag("v1.0", tagged)
	src := hfSource(t, hub.URL)

	for _, tc := range []struct {
		rev, commit, content string
	}{
		{"main", tagged, "tagged"},
		{"dev", dev, "dev"},
		{"v1.0", tagged, "tagged"},
		{"refs/pr/1", pr, "pr"},
		{first, first, "main"},
	} {
		t.Run(strings.ReplaceAll(tc.rev, "/", "_"), func(t *testing.T) {
			t.Parallel()
			res, err := hfResolve(t, src, "hf://org/model@"+tc.rev)
			require.NoError(t, err)
			assert.Equal(t, tc.commit, res.Model.Revision)
			dir, err := hfFetch(t, hfStore(t), res)
			require.NoError(t, err)
			checkDir(t, dir, v(tc.content))
		})
	}
}

func TestCommitSkipsRevisionLookup(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	repo := hub.AddRepo("model", map[string]hubtest.Content{"a.json": hubtest.String("{}")})
	res, err := hfResolve(t, hfSource(t, hub.URL), "hf://model@"+repo.Resolve("main"))
	require.NoError(t, err)
	assert.Equal(t, "model", res.Model.Name)
	assert.Zero(t, hub.Stats().Requests[hubtest.RouteInfo], "a commit needs no lookup")
}

func TestPrivateAndGated(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(5000, 1)}
	hub.AddRepo("org/private", files, hubtest.Private("hf_secret"))
	hub.AddRepo("org/gated", files, hubtest.Gated("hf_secret"))
	hub.AddRepo("org/gated-lfs", map[string]hubtest.Content{"model.safetensors": hubtest.Generated(5000, 1)}, hubtest.Gated("hf_secret"))

	_, err := hfResolve(t, hfSource(t, hub.URL), "hf://org/private")
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrPermanent)
	var se *source.StatusError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusUnauthorized, se.StatusCode)
	assert.Contains(t, err.Error(), `hub error "RepoNotFound"`)
	assert.Contains(t, err.Error(), "HF_TOKEN")
	t.Log(err)

	_, err = hfResolve(t, hfSource(t, hub.URL, hf.WithToken("hf_wrong")), "hf://org/private")
	assert.ErrorIs(t, err, content.ErrPermanent)

	_, err = hfResolve(t, hfSource(t, hub.URL), "hf://org/gated")
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), `hub error "GatedRepo"`)
	assert.Contains(t, err.Error(), `"config.json"`)
	t.Log(err)

	// Only LFS files: the listing is public, the download is not.
	res, err := hfResolve(t, hfSource(t, hub.URL, hf.WithToken("hf_wrong")), "hf://org/gated-lfs")
	require.NoError(t, err)
	_, err = res.Blobs[res.Model.Files[0].Digest].OpenRange(t.Context(), 0)
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusForbidden, se.StatusCode)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), "GatedRepo")

	authed := hfSource(t, hub.URL, hf.WithToken("hf_secret"))
	for _, name := range []string{"org/private", "org/gated"} {
		res, err := hfResolve(t, authed, "hf://"+name)
		require.NoError(t, err, name)
		dir, err := hfFetch(t, hfStore(t), res)
		require.NoError(t, err, name)
		checkDir(t, dir, files)
	}
}

// TestTokenStaysOnHub serves LFS bytes from another server, which refuses
// (400) requests carrying Authorization, as presigned object stores do.
func TestTokenStaysOnHub(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithSeparateCDN())
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(300_000, 1)}
	hub.AddRepo("org/private", files, hubtest.Private("hf_secret"))
	require.NotEqual(t, hub.URL, hub.CDNURL)

	// Go's client alone would forward the header: the CDN has the same host
	// name on another port. The source must not.
	var sawAuth []string
	client := &http.Client{CheckRedirect: func(req *http.Request, via []*http.Request) error {
		sawAuth = append(sawAuth, req.Header.Get("Authorization"))
		return nil
	}}
	src, err := hf.New(client, hf.WithEndpoint(hub.URL), hf.WithToken("hf_secret"))
	require.NoError(t, err)
	res, err := hfResolve(t, src, "hf://org/private")
	require.NoError(t, err)
	dir, err := hfFetch(t, hfStore(t), res)
	require.NoError(t, err)
	checkDir(t, dir, files)
	assert.Zero(t, hub.Stats().CDNAuthorized)
	assert.NotEmpty(t, sawAuth, "the download was redirected")
	for _, a := range sawAuth {
		assert.Empty(t, a)
	}
}

func TestNotFound(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo("org/model", map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(1000, 1)})
	src := hfSource(t, hub.URL)

	for ref, code := range map[string]string{
		"hf://org/none":                             "RepoNotFound",
		"hf://org/model@nope":                       "RevisionNotFound",
		"hf://org/model@" + strings.Repeat("a", 40): "RevisionNotFound",
	} {
		_, err := hfResolve(t, src, ref)
		require.Error(t, err, ref)
		assert.ErrorIs(t, err, content.ErrPermanent, ref)
		assert.Contains(t, err.Error(), `hub error "`+code+`"`, ref)
		assert.Contains(t, err.Error(), "HTTP 404", ref)
	}

	// A file the listing names but the hub no longer serves.
	front := hubFront(t, hub, func(w http.ResponseWriter, r *http.Request) bool {
		if strings.HasSuffix(r.URL.Path, "/model.safetensors") {
			w.Header().Set("X-Error-Code", "EntryNotFound")
			w.Header().Set("X-Error-Message", "Entry not found")
			http.Error(w, `{"error":"Entry not found"}`, http.StatusNotFound)
			return true
		}
		return false
	})
	res, err := hfResolve(t, hfSource(t, front), "hf://org/model")
	require.NoError(t, err)
	_, err = hfFetch(t, hfStore(t), res)
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), `hub error "EntryNotFound": "Entry not found"): no such file`)
}

// hubFront serves hub behind another server, under the path prefix /mirror,
// answering itself the requests intercept takes.
func hubFront(t *testing.T, hub *hubtest.Hub, intercept func(http.ResponseWriter, *http.Request) bool) string {
	t.Helper()
	target, err := url.Parse(hub.URL)
	require.NoError(t, err)
	proxy := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target) }}
	srv := httptest.NewServer(http.StripPrefix("/mirror", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if intercept == nil || !intercept(w, r) {
			proxy.ServeHTTP(w, r)
		}
	})))
	t.Cleanup(srv.Close)
	return srv.URL + "/mirror/"
}

func TestRetriable(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(2<<20, 1)}
	hub.AddRepo("org/model", files)
	src := hfSource(t, hub.URL)

	for _, tc := range []struct {
		route  hubtest.Route
		status int
	}{
		{hubtest.RouteInfo, http.StatusTooManyRequests},
		{hubtest.RouteTree, http.StatusInternalServerError},
		{hubtest.RouteResolve, http.StatusBadGateway},
	} {
		hub.Fail(tc.route, tc.status, 1)
		_, err := hfResolve(t, src, "hf://org/model")
		require.Error(t, err, tc.route)
		assert.NotErrorIs(t, err, content.ErrPermanent, tc.route)
		var se *source.StatusError
		require.ErrorAs(t, err, &se)
		assert.Equal(t, tc.status, se.StatusCode)
	}

	res, err := hfResolve(t, src, "hf://org/model")
	require.NoError(t, err)
	blob := res.Blobs[res.Model.Files[1].Digest]
	hub.Fail(hubtest.RouteCDN, http.StatusServiceUnavailable, 1)
	_, err = blob.OpenRange(t.Context(), 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, content.ErrPermanent)

	// The store retries 429 and 5xx from the hub and the CDN, and succeeds.
	hub.Fail(hubtest.RouteResolve, http.StatusTooManyRequests, 2)
	hub.Fail(hubtest.RouteCDN, http.StatusInternalServerError, 1)
	before := hub.Stats().Requests
	dir, err := hfFetch(t, hfStore(t), res)
	require.NoError(t, err)
	checkDir(t, dir, files)
	after := hub.Stats().Requests
	// 429, 429, redirect to a CDN 500, redirect to the CDN.
	assert.Equal(t, int64(4), after[hubtest.RouteResolve]-before[hubtest.RouteResolve])
	assert.Equal(t, int64(2), after[hubtest.RouteCDN]-before[hubtest.RouteCDN])
}

func TestLyingHub(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(3<<20, 1)}
	hub.AddRepo("org/model", files)
	src := hfSource(t, hub.URL)
	res, err := hfResolve(t, src, "hf://org/model")
	require.NoError(t, err)

	// Wrong bytes from the CDN: the store rejects the blob and keeps nothing.
	hub.Corrupt("org/model", "model.safetensors")
	store := hfStore(t)
	_, err = hfFetch(t, store, res)
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
	t.Log(err)
	for _, f := range res.Model.Files {
		if f.Path == "model.safetensors" {
			_, err := store.Stat(f.Digest)
			assert.ErrorIs(t, err, content.ErrNotFound)
		}
	}
	_, err = store.ModelDir(res.Model.Name, res.Model.Revision)
	require.NoError(t, err)
	_, err = store.Materialize(res.Model)
	assert.ErrorIs(t, err, content.ErrNotFound)

	// Wrong bytes for a git file: resolving anew fails, retriably; a source
	// that resolved the commit before knows the file's sha256, and the store
	// rejects the bytes.
	hub.Corrupt("org/model", "config.json")
	again, err := hfResolve(t, src, "hf://org/model")
	require.NoError(t, err)
	_, err = hfFetch(t, hfStore(t), again)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
	_, err = hfResolve(t, hfSource(t, hub.URL), "hf://org/model")
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
	assert.NotErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), "git blob id")
}

func TestRangesThroughRedirect(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithSeparateCDN())
	t.Cleanup(hub.Close)
	weights := hubtest.Generated(1<<20, 9)
	hub.AddRepo("org/model", map[string]hubtest.Content{"model.safetensors": weights, "config.json": hubtest.String("{}")})
	res, err := hfResolve(t, hfSource(t, hub.URL), "hf://org/model")
	require.NoError(t, err)
	want := contentBytes(t, weights)
	var blob, small content.RangeOpener
	for _, f := range res.Model.Files {
		if f.Path == "model.safetensors" {
			blob = res.Blobs[f.Digest]
		} else {
			small = res.Blobs[f.Digest]
		}
	}
	type bounded interface {
		OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error)
	}
	read := func(rc io.ReadCloser, err error) []byte {
		t.Helper()
		require.NoError(t, err)
		defer rc.Close()
		b, err := io.ReadAll(rc)
		require.NoError(t, err)
		return b
	}
	for _, off := range []int64{0, 1, 12345, 1<<20 - 1, 1 << 20} {
		assert.Equal(t, want[off:], read(blob.OpenRange(t.Context(), off)), off)
	}
	assert.Equal(t, want[4096:4096+65536], read(blob.(bounded).OpenBoundedRange(t.Context(), 4096, 65536)))
	assert.Equal(t, []byte("}"), read(small.OpenRange(t.Context(), 1)))
	assert.Equal(t, []byte("{"), read(small.(bounded).OpenBoundedRange(t.Context(), 0, 1)))
	_, err = blob.OpenRange(t.Context(), 1<<20+1)
	assert.ErrorIs(t, err, content.ErrPermanent)
}

// fakeHub answers the revision and tree endpoints with canned bodies, and
// resolve with file, if given.
func fakeHub(t *testing.T, tree func(w http.ResponseWriter, r *http.Request), file ...http.HandlerFunc) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.Contains(r.URL.Path, "/revision/"):
			io.WriteString(w, `{"id":"org/model","sha":"`+strings.Repeat("c", 40)+`"}`)
		case strings.Contains(r.URL.Path, "/tree/"):
			tree(w, r)
		case strings.Contains(r.URL.Path, "/resolve/") && len(file) > 0:
			file[0](w, r)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestUntrustedListing(t *testing.T) {
	t.Parallel()
	oid := strings.Repeat("0", 40)
	sha := strings.Repeat("a", 64)
	for name, tc := range map[string]struct {
		body, link, want string
	}{
		"parent path":    {`[{"type":"file","oid":"` + oid + `","size":1,"path":"../etc/passwd"}]`, "", "not clean"},
		"absolute path":  {`[{"type":"file","oid":"` + oid + `","size":1,"path":"/etc/passwd"}]`, "", "absolute"},
		"backslash":      {`[{"type":"file","oid":"` + oid + `","size":1,"path":"a\\b"}]`, "", "backslash"},
		"control":        {`[{"type":"file","oid":"` + oid + `","size":1,"path":"a\nb"}]`, "", "control character"},
		"negative size":  {`[{"type":"file","oid":"` + oid + `","size":-1,"path":"a"}]`, "", "negative size"},
		"bad lfs oid":    {`[{"type":"file","oid":"` + oid + `","size":1,"path":"a","lfs":{"oid":"x","size":1}}]`, "", "not a sha256"},
		"lfs size":       {`[{"type":"file","oid":"` + oid + `","size":1,"path":"a","lfs":{"oid":"` + sha + `","size":2}}]`, "", "LFS size 2"},
		"bad git oid":    {`[{"type":"file","oid":"zz","size":1,"path":"a"}]`, "", "not a git blob id"},
		"unknown type":   {`[{"type":"submodule","path":"a"}]`, "", `type "submodule"`},
		"not json":       {`<html>`, "", "invalid"},
		"trailing data":  {`[] []`, "", "data after"},
		"duplicate":      {`[{"type":"file","oid":"` + oid + `","size":0,"path":"a","lfs":{"oid":"` + sha + `","size":0}},{"type":"file","oid":"` + oid + `","size":0,"path":"a","lfs":{"oid":"` + sha + `","size":0}}]`, "", "duplicate file"},
		"file and dir":   {`[{"type":"file","oid":"` + oid + `","size":0,"path":"a","lfs":{"oid":"` + sha + `","size":0}},{"type":"file","oid":"` + oid + `","size":0,"path":"a/b","lfs":{"oid":"` + sha + `","size":0}}]`, "", "both a file and a directory"},
		"large git file": {`[{"type":"file","oid":"` + oid + `","size":16777217,"path":"big.json"}]`, "", "not stored with LFS"},
		"empty":          {`[]`, "", "no files"},
		"foreign next":   {`[]`, `<http://elsewhere.example/api/models/org/model/tree/x?cursor=1>; rel="next"`, "is not on the hub"},
		"looping next":   {`[]`, `<?recursive=true>; rel="next"`, "loop"},
		"bad link":       {`[]`, `http://x; rel="next"`, "want <URI>"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			endpoint := fakeHub(t, func(w http.ResponseWriter, r *http.Request) {
				if tc.link != "" {
					w.Header().Set("Link", tc.link)
				}
				io.WriteString(w, tc.body)
			})
			_, err := hfResolve(t, hfSource(t, endpoint), "hf://org/model")
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrPermanent)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestServerIgnoringRange(t *testing.T) {
	t.Parallel()
	data := []byte("0123456789")
	d := digest.FromBytes(data)
	endpoint := fakeHub(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `[{"type":"file","oid":"`+strings.Repeat("0", 40)+`","size":10,"path":"m.bin","lfs":{"oid":"`+d.Encoded()+`","size":10,"pointerSize":130}}]`)
	}, func(w http.ResponseWriter, r *http.Request) {
		w.Write(data) // 200 whatever the Range
	})
	res, err := hfResolve(t, hfSource(t, endpoint), "hf://org/model")
	require.NoError(t, err)
	rc, err := res.Blobs[d].OpenRange(t.Context(), 0)
	require.NoError(t, err)
	got, err := io.ReadAll(rc)
	rc.Close()
	require.NoError(t, err)
	assert.Equal(t, data, got)
	_, err = res.Blobs[d].OpenRange(t.Context(), 5)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), "ignored Range")
}

func TestListingTooLarge(t *testing.T) {
	t.Parallel()
	endpoint := fakeHub(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "[")
		entry := `{"type":"directory","oid":"` + strings.Repeat("0", 40) + `","size":0,"path":"` + strings.Repeat("d", 200) + `"},`
		for range (httpsource.MaxManifestSize*4)/len(entry) + 1 {
			if _, err := io.WriteString(w, entry); err != nil {
				return
			}
		}
	})
	_, err := hfResolve(t, hfSource(t, endpoint), "hf://org/model")
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, err.Error(), "bytes allowed")
}

func TestOptions(t *testing.T) {
	t.Parallel()
	for _, opt := range []hf.Option{
		hf.WithEndpoint("ftp://hub"),
		hf.WithEndpoint("https://user:pw@hub"),
		hf.WithEndpoint("https://hub?x=1"),
		hf.WithEndpoint("hub.example"),
		hf.WithEndpoint("https://hub:99999"),
		hf.WithToken("a b"),
		hf.WithToken("tok\n"),
	} {
		_, err := hf.New(nil, opt)
		assert.ErrorIs(t, err, content.ErrInvalid)
	}
	src, err := hf.New(nil)
	require.NoError(t, err)
	_, err = src.Resolve(t.Context(), ref.Ref{Kind: ref.KindOCI})
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	assert.ErrorIs(t, err, content.ErrPermanent)
}

func TestEndpointWithPath(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{"config.json": hubtest.String("{}"), "model.safetensors": hubtest.Generated(1000, 1)}
	hub.AddRepo("org/model", files)
	res, err := hfResolve(t, hfSource(t, hubFront(t, hub, nil)), "hf://org/model")
	require.NoError(t, err)
	dir, err := hfFetch(t, hfStore(t), res)
	require.NoError(t, err)
	checkDir(t, dir, files)
}

func TestStalledHubIsRetriable(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	endpoint := fakeHub(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	parsed, err := ref.Parse("hf://org/model")
	require.NoError(t, err)
	_, err = hfSource(t, endpoint).Resolve(ctx, parsed)
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.NotErrorIs(t, err, content.ErrPermanent)
}

// A branch resolved again to the commit it named before reads neither the
// listing nor the files stored in git a second time: a listing at a commit
// never changes. The files are still fetched from the hub when a store
// lacks them.
func TestResolvingACommitAgainReadsNothing(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithPageSize(3))
	t.Cleanup(hub.Close)
	files := modelFiles()
	hub.AddRepo("org/again", files)
	src := hfSource(t, hub.URL)

	first, err := hfResolve(t, src, "hf://org/again")
	require.NoError(t, err)
	before := hub.Stats()
	again, err := hfResolve(t, src, "hf://org/again@main")
	require.NoError(t, err)
	after := hub.Stats()
	assert.Equal(t, first.Model, again.Model)
	assert.Equal(t, before.Bytes, after.Bytes, "no file read again")
	assert.Equal(t, before.Requests[hubtest.RouteTree], after.Requests[hubtest.RouteTree], "no listing read again")
	assert.Equal(t, before.Requests[hubtest.RouteInfo]+1, after.Requests[hubtest.RouteInfo], "the branch is looked up each time")

	dir, err := hfFetch(t, hfStore(t), again)
	require.NoError(t, err)
	checkDir(t, dir, files)
}
