package hubtest_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
)

func get(t *testing.T, url string, header ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func readAll(t *testing.T, resp *http.Response) []byte {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return b
}

func TestHubInfoAndTree(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithPageSize(2))
	defer hub.Close()
	weights := hubtest.Generated(3<<20, 1)
	repo := hub.AddRepo("org/model", map[string]hubtest.Content{
		"config.json":            hubtest.String(`{"a":1}`),
		"model.safetensors":      weights,
		"sub/dir/tokenizer.json": hubtest.String("tok"),
	})
	main := repo.Resolve("main")
	require.Len(t, main, 40)

	resp := get(t, hub.URL+"/api/models/org/model/revision/main?blobs=true")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var info struct {
		ID       string `json:"id"`
		SHA      string `json:"sha"`
		Siblings []struct {
			RFilename string `json:"rfilename"`
			BlobID    string `json:"blobId"`
			Size      int64  `json:"size"`
			LFS       *struct {
				SHA256      string `json:"sha256"`
				Size        int64  `json:"size"`
				PointerSize int    `json:"pointerSize"`
			} `json:"lfs"`
		} `json:"siblings"`
	}
	require.NoError(t, json.Unmarshal(readAll(t, resp), &info))
	assert.Equal(t, "org/model", info.ID)
	assert.Equal(t, main, info.SHA)
	require.Len(t, info.Siblings, 3)
	assert.Equal(t, "model.safetensors", info.Siblings[1].RFilename)
	require.NotNil(t, info.Siblings[1].LFS)
	assert.Equal(t, hub.SHA256("org/model", "main", "model.safetensors"), info.Siblings[1].LFS.SHA256)
	assert.Equal(t, int64(3<<20), info.Siblings[1].LFS.Size)
	assert.Nil(t, info.Siblings[0].LFS)
	assert.Equal(t, int64(7), info.Siblings[0].Size)
	assert.Len(t, info.Siblings[0].BlobID, 40)

	// expand selects properties.
	resp = get(t, hub.URL+"/api/models/org/model/revision/main?expand=sha")
	var m map[string]any
	require.NoError(t, json.Unmarshal(readAll(t, resp), &m))
	assert.Equal(t, map[string]any{"_id": m["_id"], "id": "org/model", "sha": main}, m)

	// The recursive tree, two entries a page.
	var paths []string
	next := hub.URL + "/api/models/org/model/tree/main?recursive=true"
	pages := 0
	for next != "" {
		resp := get(t, next)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		var entries []struct {
			Type string `json:"type"`
			Path string `json:"path"`
			OID  string `json:"oid"`
			LFS  *struct {
				OID string `json:"oid"`
			} `json:"lfs"`
		}
		require.NoError(t, json.Unmarshal(readAll(t, resp), &entries))
		for _, e := range entries {
			paths = append(paths, e.Type+":"+e.Path)
			assert.Len(t, e.OID, 40)
			if e.Path == "model.safetensors" {
				require.NotNil(t, e.LFS)
				assert.Len(t, e.LFS.OID, 64)
			}
		}
		next = ""
		if l := resp.Header.Get("Link"); l != "" {
			next = strings.TrimPrefix(strings.TrimSuffix(l, `>; rel="next"`), "<")
		}
		pages++
	}
	assert.Equal(t, 3, pages)
	assert.Equal(t, []string{"file:config.json", "file:model.safetensors", "directory:sub", "directory:sub/dir", "file:sub/dir/tokenizer.json"}, paths)

	// Not recursive, under a path escaped as one segment.
	resp = get(t, hub.URL+"/api/models/org/model/tree/main/sub%2Fdir")
	assert.Contains(t, string(readAll(t, resp)), `"path":"sub/dir/tokenizer.json"`)
}

func TestHubResolve(t *testing.T) {
	t.Parallel()
	for _, separate := range []bool{false, true} {
		var opts []hubtest.Option
		if separate {
			opts = append(opts, hubtest.WithSeparateCDN())
		}
		hub := hubtest.New(opts...)
		defer hub.Close()
		data := make([]byte, 1000)
		for i := range data {
			data[i] = byte(i)
		}
		repo := hub.AddRepo("gpt", map[string]hubtest.Content{
			"config.json": hubtest.String("{}"),
			"w.bin":       hubtest.Bytes(data),
		})
		pr := repo.Commit("refs/pr/1", "pr", map[string]hubtest.Content{"w.bin": hubtest.Bytes(data[:10])})

		resp := get(t, hub.URL+"/gpt/resolve/main/config.json")
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, "{}", string(readAll(t, resp)))
		assert.Equal(t, repo.Resolve("main"), resp.Header.Get("X-Repo-Commit"))
		assert.Equal(t, `"9e26dfeeb6e641a33dae4961196235bdb965b21b"`, resp.Header.Get("ETag")) // git hash-object of "{}"

		resp = get(t, hub.URL+"/gpt/resolve/main/w.bin")
		require.Equal(t, http.StatusFound, resp.StatusCode)
		sum := sha256.Sum256(data)
		assert.Equal(t, `"`+hex.EncodeToString(sum[:])+`"`, resp.Header.Get("X-Linked-Etag"))
		assert.Equal(t, "1000", resp.Header.Get("X-Linked-Size"))
		loc := resp.Header.Get("Location")
		require.True(t, strings.HasPrefix(loc, hub.CDNURL+"/cdn/"), loc)

		resp = get(t, loc, "Range", "bytes=100-")
		require.Equal(t, http.StatusPartialContent, resp.StatusCode)
		assert.Equal(t, "bytes 100-999/1000", resp.Header.Get("Content-Range"))
		assert.Equal(t, data[100:], readAll(t, resp))

		// A tampered signature is refused.
		resp = get(t, strings.Replace(loc, "Signature=", "Signature=00", 1))
		assert.Equal(t, http.StatusForbidden, resp.StatusCode)

		// A revision with '/', escaped or not.
		for _, rev := range []string{"refs%2Fpr%2F1", "refs/pr/1", pr} {
			resp = get(t, hub.URL+"/gpt/resolve/"+rev+"/w.bin")
			require.Equal(t, http.StatusFound, resp.StatusCode, rev)
			assert.Equal(t, pr, resp.Header.Get("X-Repo-Commit"))
			assert.Equal(t, "10", resp.Header.Get("X-Linked-Size"))
		}

		resp = get(t, loc, "Authorization", "Bearer x")
		if separate {
			assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
		} else {
			assert.Equal(t, http.StatusOK, resp.StatusCode)
		}
		assert.Equal(t, int64(1), hub.Stats().CDNAuthorized)
		st := hub.Stats()
		assert.Equal(t, int64(2), st.Bytes-st.CDNBytes, "git file bytes")
		assert.Equal(t, int64(5), st.Requests[hubtest.RouteResolve])
	}
}

func TestHubErrors(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	defer hub.Close()
	hub.AddRepo("org/private", map[string]hubtest.Content{"a.txt": hubtest.String("a")}, hubtest.Private("secret"))
	hub.AddRepo("org/gated", map[string]hubtest.Content{"a.txt": hubtest.String("a")}, hubtest.Gated("secret"))
	hub.AddRepo("org/public", map[string]hubtest.Content{"a.txt": hubtest.String("a")})

	for _, tc := range []struct {
		url, token string
		status     int
		code       string
	}{
		{"/api/models/org/none/revision/main", "", 404, "RepoNotFound"},
		{"/api/models/org/private/revision/main", "", 401, "RepoNotFound"},
		{"/api/models/org/private/revision/main", "wrong", 401, "RepoNotFound"},
		{"/api/models/org/private/revision/main", "secret", 200, ""},
		{"/api/models/org/public/revision/nope", "", 404, "RevisionNotFound"},
		{"/api/models/org/public/tree/nope", "", 404, "RevisionNotFound"},
		{"/org/public/resolve/main/b.txt", "", 404, "EntryNotFound"},
		{"/org/public/resolve/nope/a.txt", "", 404, "RevisionNotFound"},
		{"/api/models/org/gated/revision/main", "", 200, ""},
		{"/org/gated/resolve/main/a.txt", "", 401, "GatedRepo"},
		{"/org/gated/resolve/main/a.txt", "wrong", 403, "GatedRepo"},
		{"/org/gated/resolve/main/a.txt", "secret", 200, ""},
	} {
		var h []string
		if tc.token != "" {
			h = []string{"Authorization", "Bearer " + tc.token}
		}
		resp := get(t, hub.URL+tc.url, h...)
		assert.Equal(t, tc.status, resp.StatusCode, tc.url)
		assert.Equal(t, tc.code, resp.Header.Get("X-Error-Code"), tc.url)
	}

	hub.Fail(hubtest.RouteResolve, http.StatusTooManyRequests, 1)
	hub.Fail(hubtest.RouteResolve, http.StatusInternalServerError, 1)
	resp := get(t, hub.URL+"/org/public/resolve/main/a.txt")
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))
	assert.Equal(t, http.StatusInternalServerError, get(t, hub.URL+"/org/public/resolve/main/a.txt").StatusCode)
	assert.Equal(t, http.StatusOK, get(t, hub.URL+"/org/public/resolve/main/a.txt").StatusCode)

	hub.Corrupt("org/public", "a.txt")
	assert.Equal(t, []byte{'a' ^ 0xff}, readAll(t, get(t, hub.URL+"/org/public/resolve/main/a.txt")))
}

func TestGenerated(t *testing.T) {
	t.Parallel()
	g := hubtest.Generated(100, 7)
	all := make([]byte, 100)
	n, err := g.ReadAt(all, 0)
	require.NoError(t, err)
	require.Equal(t, 100, n)
	assert.Equal(t, all, readSection(t, hubtest.Generated(100, 7), 0, 100))
	assert.NotEqual(t, all, readSection(t, hubtest.Generated(100, 8), 0, 100))
	for _, off := range []int64{1, 7, 8, 13, 99} {
		assert.Equal(t, all[off:], readSection(t, g, off, 100-off), off)
	}
	p := make([]byte, 10)
	n, err = g.ReadAt(p, 95)
	assert.Equal(t, 5, n)
	assert.ErrorIs(t, err, io.EOF)
}

func readSection(t *testing.T, c hubtest.Content, off, n int64) []byte {
	t.Helper()
	var b bytes.Buffer
	_, err := io.Copy(&b, io.NewSectionReader(c, off, n))
	require.NoError(t, err)
	return b.Bytes()
}

func TestHubStorage(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	defer hub.Close()
	hub.AddRepo("org/model", map[string]hubtest.Content{
		"small.safetensors": hubtest.As(hubtest.Git, hubtest.String("x")),
		"notes.txt":         hubtest.As(hubtest.LFS, hubtest.String("y")),
		"big.json":          hubtest.Generated(10<<20, 1),
		"events.tfevents.1": hubtest.String("z"),
	})
	for p, status := range map[string]int{"small.safetensors": 200, "notes.txt": 302, "big.json": 302, "events.tfevents.1": 302} {
		assert.Equal(t, status, get(t, hub.URL+"/org/model/resolve/main/"+p).StatusCode, p)
	}
}

func TestHubAddr(t *testing.T) {
	t.Parallel()
	hub := hubtest.New(hubtest.WithAddr("0.0.0.0:0"), hubtest.WithSeparateCDN(), hubtest.WithPageSize(1))
	defer hub.Close()
	hub.AddRepo("org/model", map[string]hubtest.Content{"a.bin": hubtest.String("a"), "b.bin": hubtest.String("b")})
	_, port, err := net.SplitHostPort(strings.TrimPrefix(hub.URL, "http://"))
	require.NoError(t, err)
	base := "http://localhost:" + port
	resp := get(t, base+"/org/model/resolve/main/a.bin")
	require.Equal(t, http.StatusFound, resp.StatusCode)
	_, cdnPort, err := net.SplitHostPort(strings.TrimPrefix(hub.CDNURL, "http://"))
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(resp.Header.Get("Location"), "http://localhost:"+cdnPort+"/cdn/"), resp.Header.Get("Location"))
	assert.Equal(t, "a", string(readAll(t, get(t, resp.Header.Get("Location")))))
	resp = get(t, base+"/api/models/org/model/tree/main")
	assert.True(t, strings.HasPrefix(resp.Header.Get("Link"), "<"+base+"/api/models/org/model/tree/main?cursor="), resp.Header.Get("Link"))
}

func TestHubServe(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	hub.AddRepo("org/model", map[string]hubtest.Content{"a.bin": hubtest.As(hubtest.LFS, hubtest.String("a"))})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hub.Serve(ln)
	base := "http://" + ln.Addr().String()
	resp := get(t, base+"/org/model/resolve/main/a.bin")
	require.Equal(t, http.StatusFound, resp.StatusCode)
	// The redirect names the listener the request came in on.
	assert.True(t, strings.HasPrefix(resp.Header.Get("Location"), base+"/cdn/"), resp.Header.Get("Location"))
	assert.Equal(t, "a", string(readAll(t, get(t, resp.Header.Get("Location")))))
	assert.Equal(t, int64(1), hub.Stats().Requests[hubtest.RouteCDN], "one hub, whichever listener")

	hub.Close()
	_, err = http.Get(base + "/org/model/resolve/main/a.bin")
	assert.Error(t, err, "the extra listener outlived Close")
}
