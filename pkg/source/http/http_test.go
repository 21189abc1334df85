package httpsource_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/genmodel/genmodeltest"
	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// resolveFile resolves a digest-pinned reference to url and returns its one
// opener.
func resolveFile(t *testing.T, src *httpsource.Source, rawURL string, d digest.Digest) (*source.Resolution, content.RangeOpener) {
	t.Helper()
	r, err := ref.Parse(rawURL + "#" + d.String())
	require.NoError(t, err)
	res, err := src.Resolve(t.Context(), r)
	require.NoError(t, err)
	require.Contains(t, res.Blobs, d)
	return res, res.Blobs[d]
}

// rangeHandler answers HEAD with the blob's size and GET with getFn.
func rangeHandler(data []byte, getFn func(w http.ResponseWriter, r *http.Request, off int64)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Length", strconv.Itoa(len(data)))
			return
		}
		off := int64(0)
		if rng := r.Header.Get("Range"); rng != "" {
			var err error
			off, err = strconv.ParseInt(strings.TrimSuffix(strings.TrimPrefix(rng, "bytes="), "-"), 10, 64)
			if err != nil {
				http.Error(w, "bad range", http.StatusBadRequest)
				return
			}
		}
		getFn(w, r, off)
	})
}

func TestBlobOpenRange(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(10_000)
	n := int64(len(data))
	partial := func(first, last, total int64, body []byte) func(http.ResponseWriter, *http.Request, int64) {
		return func(w http.ResponseWriter, _ *http.Request, _ int64) {
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", first, last, total))
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(body)
		}
	}
	status := func(code int) func(http.ResponseWriter, *http.Request, int64) {
		return func(w http.ResponseWriter, _ *http.Request, _ int64) { http.Error(w, "no", code) }
	}
	tests := []struct {
		name      string
		get       func(w http.ResponseWriter, r *http.Request, off int64)
		off       int64
		want      []byte // nil: an error is expected
		permanent bool
		is        error
	}{
		{name: "range honoured", off: 1234, want: data[1234:],
			get: func(w http.ResponseWriter, r *http.Request, _ int64) {
				http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
			}},
		{name: "range from zero", off: 0, want: data,
			get: func(w http.ResponseWriter, r *http.Request, _ int64) {
				http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
			}},
		{name: "range ignored at zero", off: 0, want: data,
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) { w.Write(data) }},
		{name: "range ignored, prefix discarded", off: 6000, want: data[6000:],
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) { w.Write(data) }},
		{name: "range ignored, wrong length", off: 0, permanent: true, is: content.ErrSizeMismatch,
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) { w.Write(data[:500]) }},
		{name: "wrong total", off: 100, permanent: true, is: content.ErrSizeMismatch,
			get: partial(100, n, n+1, data[100:])},
		{name: "wrong start", off: 100, get: partial(0, n-1, n, data)},
		{name: "wrong end", off: 100, get: partial(100, n-2, n, data[100:n-1])},
		{name: "no total", off: 100, want: data[100:],
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				w.Header().Set("Content-Range", fmt.Sprintf("bytes 100-%d/*", n-1))
				w.WriteHeader(http.StatusPartialContent)
				w.Write(data[100:])
			}},
		{name: "garbled Content-Range", off: 100,
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				w.Header().Set("Content-Range", "bytes=100-")
				w.WriteHeader(http.StatusPartialContent)
			}},
		{name: "Content-Length disagrees", off: 100,
			get: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				w.Header().Set("Content-Range", fmt.Sprintf("bytes 100-%d/%d", n-1, n))
				w.Header().Set("Content-Length", "50")
				w.WriteHeader(http.StatusPartialContent)
				w.Write(data[100:150])
			}},
		{name: "416", off: 100, permanent: true, is: content.ErrSizeMismatch, get: status(http.StatusRequestedRangeNotSatisfiable)},
		{name: "400", off: 0, permanent: true, get: status(http.StatusBadRequest)},
		{name: "401", off: 0, permanent: true, get: status(http.StatusUnauthorized)},
		{name: "403", off: 0, permanent: true, get: status(http.StatusForbidden)},
		{name: "404", off: 0, permanent: true, get: status(http.StatusNotFound)},
		{name: "410", off: 0, permanent: true, get: status(http.StatusGone)},
		{name: "408", off: 0, get: status(http.StatusRequestTimeout)},
		{name: "429", off: 0, get: status(http.StatusTooManyRequests)},
		{name: "500", off: 0, get: status(http.StatusInternalServerError)},
		{name: "502", off: 0, get: status(http.StatusBadGateway)},
		{name: "503", off: 0, get: status(http.StatusServiceUnavailable)},
		{name: "304", off: 0, get: status(http.StatusNotModified)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(rangeHandler(data, tt.get))
			defer srv.Close()
			_, op := resolveFile(t, httpsource.New(srv.Client()), srv.URL+"/w.bin?sig=secret", d)

			body, err := op.OpenRange(t.Context(), tt.off)
			if tt.want == nil {
				require.Error(t, err)
				assert.Equal(t, tt.permanent, errors.Is(err, content.ErrPermanent), "permanent: %v", err)
				if tt.is != nil {
					assert.ErrorIs(t, err, tt.is)
				}
				assert.NotContains(t, err.Error(), "secret", "errors carry no query")
				return
			}
			require.NoError(t, err)
			defer body.Close()
			got, err := io.ReadAll(body)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestBlobStatusError(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(100)
	srv := httptest.NewServer(rangeHandler(data, func(w http.ResponseWriter, _ *http.Request, _ int64) {
		http.Error(w, "gone", http.StatusNotFound)
	}))
	defer srv.Close()
	_, op := resolveFile(t, httpsource.New(srv.Client()), srv.URL+"/w.bin", d)
	_, err := op.OpenRange(t.Context(), 0)
	var se *source.StatusError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusNotFound, se.StatusCode)
	assert.Equal(t, http.MethodGet, se.Method)
	assert.Equal(t, srv.URL+"/w.bin", se.URL)
}

func TestBlobEdges(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(100)
	var gets int
	var mu sync.Mutex
	srv := httptest.NewServer(rangeHandler(data, func(w http.ResponseWriter, r *http.Request, _ int64) {
		mu.Lock()
		gets++
		mu.Unlock()
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	defer srv.Close()
	_, op := resolveFile(t, httpsource.New(srv.Client()), srv.URL+"/w.bin", d)

	body, err := op.OpenRange(t.Context(), 100)
	require.NoError(t, err, "the end of the blob is an empty read")
	got, err := io.ReadAll(body)
	require.NoError(t, err)
	assert.Empty(t, got)
	assert.Zero(t, gets, "no request for an empty range")

	for _, off := range []int64{-1, 101} {
		_, err := op.OpenRange(t.Context(), off)
		assert.ErrorIs(t, err, content.ErrPermanent, "offset %d", off)
		assert.ErrorIs(t, err, content.ErrInvalid, "offset %d", off)
	}

	// A dead origin is a transient error.
	srv.Close()
	_, err = op.OpenRange(t.Context(), 0)
	require.Error(t, err)
	assert.NotErrorIs(t, err, content.ErrPermanent)

	// A cancelled context is reported as such.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = op.OpenRange(ctx, 0)
	assert.ErrorIs(t, err, context.Canceled)
}

func TestHeaders(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(100)
	agents := make(chan string, 4)
	ranges := make(chan string, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		agents <- r.Header.Get("User-Agent")
		ranges <- r.Method + " " + r.Header.Get("Range") + " " + r.Header.Get("Accept-Encoding")
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	defer srv.Close()
	_, op := resolveFile(t, httpsource.New(srv.Client(), httpsource.WithVersion("1.2.3")), srv.URL+"/w.bin", d)
	body, err := op.OpenRange(t.Context(), 10)
	require.NoError(t, err)
	body.Close()
	assert.Equal(t, "weightd/1.2.3", <-agents)
	assert.Equal(t, "weightd/1.2.3", <-agents)
	assert.Equal(t, "HEAD  ", <-ranges)
	assert.Equal(t, "GET bytes=10- identity", <-ranges)
}

func TestResolveFile(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(5000)
	tests := []struct {
		name string
		head func(w http.ResponseWriter)
		data []byte
	}{
		{"HEAD", nil, data},
		{"HEAD refused", func(w http.ResponseWriter) { w.WriteHeader(http.StatusMethodNotAllowed) }, data},
		{"HEAD forbidden (presigned for GET)", func(w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) }, data},
		{"HEAD without length", func(w http.ResponseWriter) { w.WriteHeader(http.StatusOK) }, data},
		{"HEAD refused, empty file", func(w http.ResponseWriter) { w.WriteHeader(http.StatusNotImplemented) }, []byte{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method == http.MethodHead && tt.head != nil {
					tt.head(w)
					return
				}
				http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(tt.data))
			}))
			defer srv.Close()
			res, _ := resolveFile(t, httpsource.New(srv.Client()), srv.URL+"/models/llama/w.bin", d)
			parsed, err := ref.Parse(srv.URL + "/models/llama/w.bin#" + d.String())
			require.NoError(t, err)
			host := strings.ReplaceAll(strings.TrimPrefix(srv.URL, "http://"), ":", "-")
			require.True(t, strings.HasPrefix(source.ModelName(parsed), host+"/models-llama-w.bin/"), source.ModelName(parsed))
			assert.Equal(t, content.Model{
				Name:     source.ModelName(parsed),
				Revision: d.Encoded()[:12],
				Files:    []content.File{{Path: "w.bin", Descriptor: content.Descriptor{Digest: d, Size: int64(len(tt.data))}}},
			}, res.Model)
		})
	}
}

func TestResolveFileErrors(t *testing.T) {
	t.Parallel()
	_, d := sourcetest.BlobData(10)
	tests := []struct {
		name      string
		handler   http.HandlerFunc
		permanent bool
	}{
		{"404", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNotFound) }, true},
		{"503", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) }, false},
		{"HEAD and GET forbidden", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusForbidden) }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			r, err := ref.Parse(srv.URL + "/w.bin#" + d.String())
			require.NoError(t, err)
			_, err = httpsource.New(srv.Client()).Resolve(t.Context(), r)
			require.Error(t, err)
			assert.Equal(t, tt.permanent, errors.Is(err, content.ErrPermanent), err.Error())
			assert.True(t, strings.HasPrefix(err.Error(), "resolving "+r.String()), err.Error())
		})
	}
}

func TestResolveManifest(t *testing.T) {
	t.Parallel()
	o := genmodeltest.Start(t, genmodel.Spec{Name: "org/gen", Files: 5, TotalBytes: 1 << 20, Seed: 9})
	s, m := o.Server, o.Manifest
	r, err := ref.Parse(s.URL() + "/" + genmodel.ManifestName)
	require.NoError(t, err)
	res, err := httpsource.New(nil).Resolve(t.Context(), r)
	require.NoError(t, err)

	assert.Equal(t, source.ModelName(r), res.Model.Name, "named after its URL, not as the manifest names itself")
	assert.Equal(t, m.Revision, res.Model.Revision, "a commit names the snapshot")
	assert.Empty(t, res.Model.Ref)
	require.Len(t, res.Model.Files, len(m.Files))
	for i, f := range m.Files {
		assert.Equal(t, content.File{Path: f.Path, Descriptor: content.Descriptor{Digest: f.Digest(), Size: f.Size}}, res.Model.Files[i])
		body, err := res.Blobs[f.Digest()].OpenRange(t.Context(), 0)
		require.NoError(t, err)
		h := sha256.New()
		n, err := io.Copy(h, body)
		body.Close()
		require.NoError(t, err)
		assert.Equal(t, f.Size, n)
		assert.Equal(t, f.Digest(), digest.NewDigest(digest.SHA256, h), f.Path)
	}
}

// A manifest is laid out under the name of its URL whatever name it gives,
// so it cannot take a hub model's place or another URL's (attack 1 of issue
// 21); a revision that is not a commit is a branch: a ref to a snapshot
// named by the files, so that other files behind it make another snapshot.
func TestLaysManifestOutUnderItsURL(t *testing.T) {
	t.Parallel()
	docs := map[string]string{
		"/a/model.json":        `{"name":"Qwen/Qwen2.5-0.5B-Instruct","revision":"main","files":[` + fileJSON("config.json", 1, hexA) + `,` + fileJSON("w.bin", 2, hexB) + `]}`,
		"/a/reordered.json":    `{"name":"org/other","revision":"v1","files":[` + fileJSON("w.bin", 2, hexB) + `,` + fileJSON("config.json", 1, hexA) + `]}`,
		"/a/changed.json":      `{"name":"Qwen/Qwen2.5-0.5B-Instruct","revision":"main","files":[` + fileJSON("config.json", 1, strings.Repeat("c", 64)) + `,` + fileJSON("w.bin", 2, hexB) + `]}`,
		"/a-model.json":        `{"name":"Qwen/Qwen2.5-0.5B-Instruct","revision":"main","files":[` + fileJSON("config.json", 1, hexA) + `]}`,
		"/a/commit/model.json": `{"name":"Qwen/Qwen2.5-0.5B-Instruct","revision":"0123456789abcdef0123456789abcdef01234567","files":[` + fileJSON("config.json", 1, hexA) + `]}`,
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, docs[r.URL.Path])
	}))
	defer srv.Close()
	src := httpsource.New(srv.Client())
	resolve := func(path string) (ref.Ref, content.Model) {
		parsed, err := ref.Parse(srv.URL + path + "?X-Amz-Signature=1")
		require.NoError(t, err)
		res, err := src.Resolve(t.Context(), parsed)
		require.NoError(t, err, path)
		return parsed, res.Model
	}

	parsed, m := resolve("/a/model.json")
	assert.Equal(t, source.ModelName(parsed), m.Name)
	assert.Len(t, strings.Split(m.Name, "/"), 3, "three parts: no hub names a model so")
	assert.Equal(t, "main", m.Ref)
	assert.Regexp(t, `^[0-9a-f]{40}$`, m.Revision)
	require.NoError(t, m.Validate())

	_, reordered := resolve("/a/reordered.json")
	assert.NotEqual(t, m.Name, reordered.Name, "another URL")
	assert.Equal(t, m.Revision, reordered.Revision, "the same files, listed in another order: the same snapshot")
	_, changed := resolve("/a/changed.json")
	assert.NotEqual(t, m.Revision, changed.Revision, "other files: another snapshot")
	_, flat := resolve("/a-model.json")
	assert.NotEqual(t, m.Name, flat.Name, "paths alike once sanitised are still other URLs")
	_, commit := resolve("/a/commit/model.json")
	assert.Equal(t, "0123456789abcdef0123456789abcdef01234567", commit.Revision)
	assert.Empty(t, commit.Ref)

	// The query (a presigned URL's signature) is no part of the name; the
	// scheme is.
	again, err := ref.Parse(srv.URL + "/a/model.json?X-Amz-Signature=2")
	require.NoError(t, err)
	assert.Equal(t, source.ModelName(parsed), source.ModelName(again))
	https, err := ref.Parse(strings.Replace(srv.URL, "http://", "https://", 1) + "/a/model.json")
	require.NoError(t, err)
	assert.NotEqual(t, source.ModelName(parsed), source.ModelName(https))
}

func TestResolveManifestFileURLs(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(300)
	var mu sync.Mutex
	var paths []string
	mux := http.NewServeMux()
	mux.HandleFunc("/m/model.json", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, manifestJSON(
			fileJSON("a dir/w.bin", 300, d.Encoded()),
			`{"path":"same.bin","size":300,"sha256":"`+d.Encoded()+`","url":"../blobs/other.bin"}`,
		))
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths = append(paths, r.URL.EscapedPath())
		mu.Unlock()
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	parsed, err := ref.Parse(srv.URL + "/m/model.json")
	require.NoError(t, err)
	res, err := httpsource.New(srv.Client()).Resolve(t.Context(), parsed)
	require.NoError(t, err)
	assert.Len(t, res.Model.Files, 2)
	assert.Len(t, res.Blobs, 1, "one blob, two files")
	body, err := res.Blobs[d].OpenRange(t.Context(), 0)
	require.NoError(t, err)
	body.Close()
	assert.Equal(t, []string{"/m/a%20dir/w.bin"}, paths, "the first file's URL serves the blob")
}

func TestResolveManifestErrors(t *testing.T) {
	t.Parallel()
	good := manifestJSON(fileJSON("a", 1, hexA))
	tests := []struct {
		name      string
		handler   http.HandlerFunc
		permanent bool
		is        error
	}{
		{"404", func(w http.ResponseWriter, _ *http.Request) { http.NotFound(w, nil) }, true, nil},
		{"500", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusInternalServerError) }, false, nil},
		{"206", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusPartialContent) }, false, nil},
		{"invalid manifest", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, good[:20]) }, true, content.ErrInvalid},
		{"path escapes", func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprint(w, manifestJSON(fileJSON("../../etc/passwd", 1, hexA)))
		}, true, content.ErrInvalid},
		{"declared too large", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(httpsource.MaxManifestSize+1))
			fmt.Fprint(w, good)
		}, true, content.ErrInvalid},
		{"streamed too large", func(w http.ResponseWriter, _ *http.Request) {
			w.(http.Flusher).Flush() // chunked: no Content-Length
			fmt.Fprint(w, good)
			pad := bytes.Repeat([]byte(" "), 1<<20)
			for range 17 {
				if _, err := w.Write(pad); err != nil {
					return
				}
			}
		}, true, content.ErrInvalid},
		{"cut short", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "1000")
			fmt.Fprint(w, good[:20])
		}, false, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			r, err := ref.Parse(srv.URL + "/model.json")
			require.NoError(t, err)
			_, err = httpsource.New(srv.Client()).Resolve(t.Context(), r)
			require.Error(t, err)
			assert.Equal(t, tt.permanent, errors.Is(err, content.ErrPermanent), err.Error())
			if tt.is != nil {
				assert.ErrorIs(t, err, tt.is)
			}
		})
	}
}

func TestUnsupported(t *testing.T) {
	t.Parallel()
	_, err := httpsource.New(nil).Resolve(t.Context(), ref.Ref{Kind: "oci"})
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	assert.ErrorIs(t, err, content.ErrPermanent)
}

func TestBlobOpenBoundedRange(t *testing.T) {
	t.Parallel()
	data, d := sourcetest.BlobData(1000)
	var mu sync.Mutex
	var ranges []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		ranges = append(ranges, r.Header.Get("Range"))
		mu.Unlock()
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	defer srv.Close()
	_, op := resolveFile(t, httpsource.New(srv.Client()), srv.URL+"/b.bin", d)
	bounded, ok := op.(interface {
		OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error)
	})
	require.True(t, ok, "HTTP blobs read bounded ranges")
	for _, tc := range []struct{ off, n int64 }{{10, 10}, {0, 1000}, {990, 10}, {500, 0}} {
		body, err := bounded.OpenBoundedRange(t.Context(), tc.off, tc.n)
		require.NoError(t, err)
		got, err := io.ReadAll(body)
		body.Close()
		require.NoError(t, err)
		assert.Equal(t, data[tc.off:tc.off+tc.n], got)
	}
	mu.Lock()
	assert.Contains(t, ranges, "bytes=10-19", "the origin is asked for exactly the bytes needed")
	mu.Unlock()
	_, err := bounded.OpenBoundedRange(t.Context(), 995, 10)
	assert.ErrorIs(t, err, content.ErrInvalid)
}
