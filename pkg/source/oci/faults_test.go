package oci_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/oci"
)

// hang waits for the request to be abandoned.
func hang(_ http.ResponseWriter, r *http.Request, _ http.Handler) { <-r.Context().Done() }

// onPath applies f to the requests whose path contains part; others pass.
func onPath(part string, f ociFault) ociFault {
	return func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if strings.Contains(r.URL.Path, part) {
			f(w, r, next)
			return
		}
		next.ServeHTTP(w, r)
	}
}

// status answers with code and a distribution-style error body.
func status(code int) ociFault {
	return func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"errors":[{"code":"TEST_%d","message":"injected"}]}`, code)
	}
}

func TestManifestFaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		fault     ociFault
		permanent bool
		notFound  bool
		want      string
	}{
		{"401", onPath("/manifests/", status(http.StatusUnauthorized)), true, false, "401"},
		{"403", onPath("/manifests/", status(http.StatusForbidden)), true, false, "TEST_403: injected"},
		{"404", onPath("/manifests/", status(http.StatusNotFound)), true, true, "404"},
		{"429", onPath("/manifests/", status(http.StatusTooManyRequests)), false, false, "429"},
		{"500", onPath("/manifests/", status(http.StatusInternalServerError)), false, false, "500"},
		{"503 ping", onPath("/v2/", status(http.StatusServiceUnavailable)), false, false, "503"},
		{"hang", onPath("/manifests/", hang), false, false, context.DeadlineExceeded.Error()},
		{"hang ping", hang, false, false, context.DeadlineExceeded.Error()},
		{"not JSON", onPath("/manifests/", func(w http.ResponseWriter, _ *http.Request, _ http.Handler) {
			w.Header().Set("Content-Type", oci.MediaTypeOCIManifest)
			io.WriteString(w, "<html>")
		}), true, false, "not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rg := newOCIRegistry(t)
			rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
			rg.setFault(tc.fault)
			ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
			defer cancel()
			_, err := oci.New().Resolve(ctx, ociRef(t, rg.host, "app:v1"))
			require.Error(t, err)
			assert.ErrorContains(t, err, tc.want)
			assert.Equal(t, tc.permanent, errors.Is(err, content.ErrPermanent), "permanent: %v", err)
			assert.Equal(t, tc.notFound, errors.Is(err, content.ErrNotFound), "not found: %v", err)
		})
	}
}

func TestBlobFaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		off       int64
		fault     ociFault
		permanent bool
		want      error
		msg       string
	}{
		{"404", 0, status(http.StatusNotFound), true, content.ErrNotFound, "404"},
		{"401", 0, status(http.StatusUnauthorized), true, nil, "401"},
		{"400", 0, status(http.StatusBadRequest), true, nil, "400"},
		{"429", 0, status(http.StatusTooManyRequests), false, nil, "429"},
		{"500", 0, status(http.StatusInternalServerError), false, nil, "500"},
		{"502", 10, status(http.StatusBadGateway), false, nil, "502"},
		{"hang", 0, hang, false, context.DeadlineExceeded, ""},
		{"range ignored", 10, func(w http.ResponseWriter, r *http.Request, next http.Handler) {
			r.Header.Del("Range")
			next.ServeHTTP(w, r)
		}, true, nil, "ignored Range"},
		{"wrong total", 10, func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
			w.Header().Set("Content-Range", "bytes 10-99/100")
			w.WriteHeader(http.StatusPartialContent)
		}, true, content.ErrSizeMismatch, "origin has 100 bytes"},
		{"wrong range", 10, func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
			w.Header().Set("Content-Range", "bytes 0-4999/5000")
			w.WriteHeader(http.StatusPartialContent)
		}, false, nil, "want bytes 10-4999/5000"},
		{"416", 10, status(http.StatusRequestedRangeNotSatisfiable), true, content.ErrSizeMismatch, "416"},
		{"whole blob of the wrong size", 0, func(w http.ResponseWriter, r *http.Request, _ http.Handler) {
			w.Header().Set("Content-Length", "3")
			io.WriteString(w, "abc")
		}, true, content.ErrSizeMismatch, "origin has 3 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rg := newOCIRegistry(t)
			d := rg.pushBlob(t, "blobs", "application/octet-stream", bytes.Repeat([]byte("x"), 5000))
			src := oci.New()
			o := src.BlobOpener(agentAuth, rg.host, "blobs", d.desc())
			// Authenticate (ping) before the fault, so it hits the blob.
			_, err := src.BlobSize(t.Context(), agentAuth, rg.host, "blobs", d.Digest)
			require.NoError(t, err)
			rg.setFault(onPath("/blobs/", tc.fault))
			ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
			defer cancel()
			r, err := o.OpenRange(ctx, tc.off)
			if r != nil {
				r.Close()
			}
			require.Error(t, err)
			assert.Equal(t, tc.permanent, errors.Is(err, content.ErrPermanent), "permanent: %v", err)
			if tc.want != nil {
				assert.ErrorIs(t, err, tc.want)
			}
			assert.ErrorContains(t, err, tc.msg)
			assert.ErrorContains(t, err, d.Digest.String())
		})
	}
}

// TestBadContent pushes documents the source must refuse, each a
// permanent error naming what is wrong.
func TestBadContent(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	cfg := rg.pushBlob(t, "bad", oci.MediaTypeOCIConfig, []byte(`{"os":"linux"}`))
	layer := rg.pushBlob(t, "bad", "application/vnd.oci.image.layer.v1.tar", sourcetest.Tar(t, sourcetest.Reg("a", "b")))
	withMT := func(d ociTDesc, mt string) *ociTDesc { d.MediaType = mt; return &d }
	doc := func(mt string, config *ociTDesc, layers ...ociTDesc) (string, []byte) {
		body, err := json.Marshal(ociTDoc{SchemaVersion: 2, MediaType: mt, Config: config, Layers: layers})
		require.NoError(t, err)
		return mt, body
	}
	for _, tc := range []struct {
		name string
		mt   string
		body []byte
		want string
	}{
		{"unknown manifest media type", "application/vnd.example.thing.v1+json", []byte(`{"schemaVersion":2,"mediaType":"application/vnd.example.thing.v1+json"}`), `unknown manifest media type "application/vnd.example.thing.v1+json"`},
		{"schema 1", "application/vnd.docker.distribution.manifest.v1+prettyjws", []byte(`{"schemaVersion":1,"name":"bad","tag":"x","fsLayers":[]}`), "schema 1"},
		{"unknown layer", "", nil, `unknown media type "application/vnd.example.layer"`},
		{"unknown config", "", nil, `unknown config media type "application/vnd.cncf.helm.config.v1+json"`},
		{"foreign layer", "", nil, "foreign layer"},
		{"unknown model layer", "", nil, `unknown media type "application/vnd.cnai.model.weight.v1.tar+lz4"`},
		{"model raw layer without path", "", nil, "has no org.cncf.model.filepath (or org.cnai.model.filepath) annotation"},
		{"model raw layer escaping", "", nil, `file path "../etc/passwd" is not a relative, clean path`},
		{"index and manifest", oci.MediaTypeOCIIndex, []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[],"layers":[]}`), "also has a config or layers"},
		{"nested index", "", nil, "itself an index"},
		{"bad digest", oci.MediaTypeOCIManifest, []byte(`{"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:abc","size":1}}`), "digest"},
		{"md5 layer", oci.MediaTypeOCIManifest, []byte(`{"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"` + cfg.Digest.String() + `","size":14},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"md5:d41d8cd98f00b204e9800998ecf8427e","size":0}]}`), "only sha256"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			mt, body := tc.mt, tc.body
			switch tc.name {
			case "unknown layer":
				mt, body = doc(oci.MediaTypeOCIManifest, &cfg, *withMT(layer, "application/vnd.example.layer"))
			case "unknown config":
				mt, body = doc(oci.MediaTypeOCIManifest, withMT(cfg, "application/vnd.cncf.helm.config.v1+json"), layer)
			case "foreign layer":
				foreign := *withMT(layer, "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip")
				foreign.URLs = []string{"https://mcr.microsoft.com/layer"}
				mt, body = doc(oci.MediaTypeDockerManifest, withMT(cfg, oci.MediaTypeDockerConfig), foreign)
			case "unknown model layer":
				mt, body = doc(oci.MediaTypeOCIManifest, withMT(cfg, oci.MediaTypeModelConfig), *withMT(layer, "application/vnd.cnai.model.weight.v1.tar+lz4"))
			case "model raw layer without path":
				mt, body = doc(oci.MediaTypeOCIManifest, withMT(cfg, oci.MediaTypeModelConfig), *withMT(layer, "application/vnd.cnai.model.weight.v1.raw"))
			case "model raw layer escaping":
				l := *withMT(layer, "application/vnd.cnai.model.weight.v1.raw")
				l.Annotations = map[string]string{oci.AnnotationModelFilepath: "../etc/passwd"}
				mt, body = doc(oci.MediaTypeOCIManifest, withMT(cfg, oci.MediaTypeModelConfig), l)
			case "nested index":
				inner := rg.pushManifest(t, "bad", "", oci.MediaTypeOCIIndex, []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}`))
				inner.Platform = map[string]string{"os": "linux", "architecture": "amd64"}
				b, err := json.Marshal(ociTDoc{SchemaVersion: 2, MediaType: oci.MediaTypeOCIIndex, Manifests: []ociTDesc{inner}})
				require.NoError(t, err)
				mt, body = oci.MediaTypeOCIIndex, b
			}
			tag := strings.ReplaceAll(tc.name, " ", "-")
			rg.pushManifest(t, "bad", tag, mt, body)
			src := oci.New(oci.WithPlatform(oci.Platform{OS: "linux", Architecture: "amd64"}))
			_, err := src.Resolve(t.Context(), ociRef(t, rg.host, "bad:"+tag))
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrPermanent)
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

func TestManifestSizeLimit(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	img := rg.pushImage(t, "big", "v1", oci.MediaTypeOCIManifest, "amd64")
	limit := int64(len(img.body) - 1)
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprint("chunked=", chunked), func(t *testing.T) {
			t.Parallel()
			src := oci.New(oci.WithMaxManifestSize(limit))
			if chunked {
				// Without Content-Length the limit applies to what is read.
				src = oci.New(oci.WithMaxManifestSize(limit), oci.WithTransport(stripLength{http.DefaultTransport}))
			}
			_, err := src.Resolve(t.Context(), ociRef(t, rg.host, "big:v1"))
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrPermanent)
			assert.ErrorContains(t, err, "larger than the limit")
			_, _, _, err = src.Manifest(t.Context(), agentAuth, rg.host, "big", "v1")
			assert.ErrorIs(t, err, content.ErrPermanent)
		})
	}
	res, err := oci.New(oci.WithMaxManifestSize(limit+1)).Resolve(t.Context(), ociRef(t, rg.host, "big:v1"))
	require.NoError(t, err)
	assert.NotNil(t, res.Image)
}

// stripLength hides the Content-Length of responses.
type stripLength struct{ rt http.RoundTripper }

func (s stripLength) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.rt.RoundTrip(r)
	if err == nil {
		resp.ContentLength = -1
		resp.Header.Del("Content-Length")
	}
	return resp, err
}

func TestDigestMismatch(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	img := rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
	other := rg.pushImage(t, "app", "v2", oci.MediaTypeOCIManifest, "arm64")
	// The registry answers the pinned digest with another manifest.
	rg.setFault(onPath("/manifests/", func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		r.URL.Path = strings.Replace(r.URL.Path, img.manifest.Digest.String(), other.manifest.Digest.String(), 1)
		next.ServeHTTP(w, r)
	}))
	src := oci.New()
	_, err := src.Resolve(t.Context(), ociRef(t, rg.host, "app@"+img.manifest.Digest.String()))
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
	assert.ErrorIs(t, err, content.ErrPermanent)
	_, _, _, err = src.Manifest(t.Context(), agentAuth, rg.host, "app", img.manifest.Digest.String())
	assert.ErrorIs(t, err, content.ErrDigestMismatch)

	t.Run("header", func(t *testing.T) {
		t.Parallel()
		rg := newOCIRegistry(t)
		rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
		rg.setFault(onPath("/manifests/", func(w http.ResponseWriter, r *http.Request, next http.Handler) {
			rec := httptest.NewRecorder()
			next.ServeHTTP(rec, r)
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.Header().Set("Docker-Content-Digest", digest.FromString("other").String())
			w.WriteHeader(rec.Code)
			w.Write(rec.Body.Bytes())
		}))
		_, err := oci.New().Resolve(t.Context(), ociRef(t, rg.host, "app:v1"))
		assert.ErrorIs(t, err, content.ErrDigestMismatch)
	})
}

// TestCorruptBlob serves a layer whose bytes do not match its digest: the
// opener passes them on, the cache refuses to commit them.
func TestCorruptBlob(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	img := rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
	res, err := oci.New().Resolve(t.Context(), ociRef(t, rg.host, "app:v1"))
	require.NoError(t, err)
	layer := img.layers[1]
	rg.setFault(onPath("/blobs/"+layer.Digest.String(), func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r)
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		body := rec.Body.Bytes()
		body[len(body)/2] ^= 0xff
		w.Write(body)
	}))
	store, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	_, err = store.Fetch(t.Context(), layer.desc(), res.Blobs[layer.Digest], nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
	_, err = store.Stat(layer.Digest)
	assert.ErrorIs(t, err, content.ErrNotFound)
	_, err = store.Fetch(t.Context(), img.config.desc(), res.Blobs[img.config.Digest], nil)
	assert.NoError(t, err, "other blobs are fine")
}

// authRegistry puts an in-process registry behind basic authentication, or
// behind bearer tokens from an in-process token server.
func authRegistry(t *testing.T, bearer bool) (*ociRegistry, *atomic.Int64) {
	t.Helper()
	rg := newOCIRegistry(t)
	const user, pass = "alice", "s3cret"
	tokens := new(atomic.Int64)
	// go-containerregistry only asks a loopback token server that shares
	// the registry's host:port.
	tokenURL := "http://" + rg.host + "/token"
	token := func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != user || p != pass {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		tokens.Add(1)
		json.NewEncoder(w).Encode(map[string]any{"token": "tok-" + r.URL.Query().Get("scope"), "expires_in": 300})
	}
	authorized := func(r *http.Request) bool {
		if bearer {
			return strings.HasPrefix(r.Header.Get("Authorization"), "Bearer tok-repository:")
		}
		u, p, ok := r.BasicAuth()
		return ok && u == user && p == pass
	}
	rg.setFault(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if bearer && r.URL.Path == "/token" {
			token(w, r)
			return
		}
		if authorized(r) {
			next.ServeHTTP(w, r)
			return
		}
		if bearer {
			w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="test"`, tokenURL))
		} else {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
		}
		status(http.StatusUnauthorized)(w, r, next)
	})
	rg.pushImage(t, "private/app", "v1", oci.MediaTypeOCIManifest, "amd64") // pushes bypass the fault
	return rg, tokens
}

func dockerConfigJSON(host, user, pass string) []byte {
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	return fmt.Appendf(nil, `{"auths":{%q:{"auth":%q}}}`, host, auth)
}

func TestAuth(t *testing.T) {
	t.Parallel()
	for _, bearer := range []bool{false, true} {
		rg, tokens := authRegistry(t, bearer)
		file := filepath.Join(t.TempDir(), "config.json")
		require.NoError(t, os.WriteFile(file, dockerConfigJSON(rg.host, "alice", "s3cret"), 0o600))
		wrongFile := filepath.Join(t.TempDir(), "config.json")
		require.NoError(t, os.WriteFile(wrongFile, dockerConfigJSON(rg.host, "alice", "wrong"), 0o600))
		for _, tc := range []struct {
			name string
			opts []oci.Option
			ok   bool
		}{
			{"anonymous", nil, false},
			{"docker config", []oci.Option{oci.WithDockerConfig(file)}, true},
			{"missing docker config", []oci.Option{oci.WithDockerConfig(filepath.Join(t.TempDir(), "none.json"))}, false},
			{"pull secret", []oci.Option{oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "s3cret"))}, true},
			{"pull secret with scheme", []oci.Option{oci.WithPullSecret(dockerConfigJSON("http://"+rg.host+"/", "alice", "s3cret"))}, true},
			{"pull secret for another registry, then the file", []oci.Option{
				oci.WithPullSecret(dockerConfigJSON("other.example.com", "bob", "x")), oci.WithDockerConfig(file)}, true},
			{"pull secret before the file", []oci.Option{
				oci.WithDockerConfig(wrongFile), oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "s3cret"))}, true},
			{"wrong password", []oci.Option{oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "wrong"))}, false},
		} {
			t.Run(fmt.Sprintf("bearer=%v/%s", bearer, tc.name), func(t *testing.T) {
				t.Parallel()
				src := oci.New(tc.opts...)
				res, err := src.Resolve(t.Context(), ociRef(t, rg.host, "private/app:v1"))
				if !tc.ok {
					require.Error(t, err)
					assert.ErrorIs(t, err, content.ErrPermanent)
					assert.ErrorContains(t, err, "401")
					return
				}
				require.NoError(t, err)
				for _, b := range res.Image.Blobs {
					readAll(t, res.Blobs[b.Digest], 0)
				}
			})
		}
		if bearer {
			t.Cleanup(func() { assert.Positive(t, tokens.Load()) })
		}
	}
}

func TestBadPullSecret(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
	for _, secret := range []string{`not json`, `{"auths":{"` + rg.host + `":{"auth":"%%%"}}}`, `{"auths":{"` + rg.host + `":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("nocolon")) + `"}}}`} {
		_, err := oci.New(oci.WithPullSecret([]byte(secret))).Resolve(t.Context(), ociRef(t, rg.host, "app:v1"))
		require.Error(t, err, secret)
		assert.ErrorIs(t, err, content.ErrPermanent)
		assert.ErrorIs(t, err, content.ErrInvalid)
	}
}

// TestRedirect sends blob reads to an object store: the Range header
// follows, the registry's credentials do not, and a presigned query stays
// out of errors.
func TestRedirect(t *testing.T) {
	t.Parallel()
	rg, _ := authRegistry(t, false)
	data := bytes.Repeat([]byte("0123456789"), 1000)
	d := rg.pushBlob(t, "private/app", "application/octet-stream", data)
	var leaked, served atomic.Int64
	var fail atomic.Bool
	store := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" {
			leaked.Add(1)
		}
		if fail.Load() || r.Method == http.MethodHead { // signed for GET only
			w.WriteHeader(http.StatusForbidden)
			return
		}
		served.Add(1)
		http.ServeContent(w, r, "blob", time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(store.Close)
	auth := rg.fault.Load()
	rg.setFault(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		if strings.Contains(r.URL.Path, "/blobs/") {
			if _, _, ok := r.BasicAuth(); !ok {
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
			http.Redirect(w, r, store.URL+"/bucket/blob?X-Amz-Signature=SECRET", http.StatusTemporaryRedirect)
			return
		}
		(*auth)(w, r, next)
	})
	src := oci.New(oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "s3cret")))
	o := src.BlobOpener(agentAuth, rg.host, "private/app", d.desc())
	for _, off := range []int64{0, 1234} {
		assert.Equal(t, data[off:], readAll(t, o, off))
	}
	assert.EqualValues(t, 2, served.Load())
	assert.Zero(t, leaked.Load(), "credentials sent to the object store")
	size, err := src.BlobSize(t.Context(), agentAuth, rg.host, "private/app", d.Digest)
	require.NoError(t, err)
	assert.Equal(t, d.Size, size)
	assert.Zero(t, leaked.Load(), "credentials sent to the object store")

	fail.Store(true)
	_, err = o.OpenRange(t.Context(), 0)
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrPermanent)
	assert.ErrorContains(t, err, "403")
	assert.NotContains(t, err.Error(), "SECRET")
}

func TestUserAgent(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	rg.pushImage(t, "app", "v1", oci.MediaTypeOCIManifest, "amd64")
	var ua atomic.Value
	rg.setFault(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
		ua.Store(r.UserAgent())
		next.ServeHTTP(w, r)
	})
	_, err := oci.New(oci.WithVersion("1.2.3")).Resolve(t.Context(), ociRef(t, rg.host, "app:v1"))
	require.NoError(t, err)
	assert.Contains(t, ua.Load(), "weightd/1.2.3")
}

// schemeRecorder records the schemes of the requests to a host and fails
// them all.
type schemeRecorder struct {
	mu      sync.Mutex
	schemes map[string]bool
}

func (s *schemeRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.schemes == nil {
		s.schemes = make(map[string]bool)
	}
	s.schemes[r.URL.Scheme] = true
	return nil, errors.New("connection refused (test)")
}

func TestInsecureRegistries(t *testing.T) {
	t.Parallel()
	for _, insecure := range []bool{false, true} {
		rec := &schemeRecorder{}
		opts := []oci.Option{oci.WithTransport(rec)}
		if insecure {
			opts = append(opts, oci.WithInsecureRegistries("registry.test:5000"))
		}
		_, err := oci.New(opts...).Resolve(t.Context(), ociRef(t, "registry.test:5000", "app:v1"))
		require.Error(t, err)
		assert.NotErrorIs(t, err, content.ErrPermanent, "a refused connection is worth retrying")
		rec.mu.Lock()
		assert.True(t, rec.schemes["https"], "https is tried")
		assert.Equal(t, insecure, rec.schemes["http"], "plain http only for an insecure registry")
		rec.mu.Unlock()
	}
}

// TestHandshakeShared opens many blobs at once from a fresh source: they
// share one authentication handshake (one token).
func TestHandshakeShared(t *testing.T) {
	t.Parallel()
	rg, tokens := authRegistry(t, true)
	d := rg.pushBlob(t, "private/app", "application/octet-stream", bytes.Repeat([]byte("z"), 4096))
	src := oci.New(oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "s3cret")))
	before := tokens.Load()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			r, err := src.BlobOpener(agentAuth, rg.host, "private/app", d.desc()).OpenRange(t.Context(), 100)
			if assert.NoError(t, err) {
				n, err := io.Copy(io.Discard, r)
				r.Close()
				assert.NoError(t, err)
				assert.EqualValues(t, 4096-100, n)
			}
		})
	}
	wg.Wait()
	assert.EqualValues(t, 1, tokens.Load()-before)
}

// A registry is pinged once, not once per repository: the challenge it
// answers is its own, and a new repository costs at most its token.
func TestOnePingPerRegistry(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"anonymous", "basic", "bearer"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			var rg *ociRegistry
			var tokens *atomic.Int64
			var opts []oci.Option
			if how == "anonymous" {
				rg, tokens = newOCIRegistry(t), new(atomic.Int64)
			} else {
				rg, tokens = authRegistry(t, how == "bearer")
				opts = append(opts, oci.WithPullSecret(dockerConfigJSON(rg.host, "alice", "s3cret")))
			}
			repos := []string{"team/a", "team/b", "team/c"}
			descs := map[string]ociTDesc{}
			for i, repo := range repos {
				descs[repo] = rg.pushBlob(t, repo, "application/octet-stream", bytes.Repeat([]byte{byte(i)}, 100))
			}
			var pings atomic.Int32
			inner := rg.fault.Load()
			rg.setFault(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
				if r.URL.Path == "/v2/" {
					pings.Add(1)
				}
				if inner != nil {
					(*inner)(w, r, next)
					return
				}
				next.ServeHTTP(w, r)
			})
			src := oci.New(opts...)
			before := tokens.Load()
			for _, repo := range repos {
				size, start, err := src.BlobStart(t.Context(), agentAuth, rg.host, repo, descs[repo].Digest, 100)
				require.NoError(t, err, repo)
				assert.EqualValues(t, 100, size)
				assert.Len(t, start, 100)
			}
			assert.EqualValues(t, 1, pings.Load(), "pings")
			if how == "bearer" {
				assert.EqualValues(t, len(repos), tokens.Load()-before, "a token per repository")
			}
		})
	}
}
