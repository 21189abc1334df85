package oci_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/oci"
)

// agentAuth is how the mirror asks for what the agent's own credentials may
// fetch.
var agentAuth = oci.RegistryAuth{Agent: true}

// ociFault intercepts the source's requests (those with weightd's
// User-Agent); it calls next to let one through.
type ociFault func(w http.ResponseWriter, r *http.Request, next http.Handler)

// ociRegistry is go-containerregistry's in-memory registry on loopback. A
// fault, when set, sees the requests of the source under test; pushes go
// straight through.
type ociRegistry struct {
	host  string
	fault atomic.Pointer[ociFault]
	auth  []authn.Authenticator // for pushes
}

func newOCIRegistry(t *testing.T) *ociRegistry {
	t.Helper()
	rg := &ociRegistry{}
	next := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if f := rg.fault.Load(); f != nil && strings.Contains(r.UserAgent(), "weightd/") {
			(*f)(w, r, next)
			return
		}
		next.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	rg.host = strings.TrimPrefix(srv.URL, "http://")
	return rg
}

func (rg *ociRegistry) setFault(f ociFault) { rg.fault.Store(&f) }

func (rg *ociRegistry) options() []remote.Option {
	if len(rg.auth) > 0 {
		return []remote.Option{remote.WithAuth(rg.auth[0])}
	}
	return nil
}

// ociTDesc and ociTDoc write test manifests.
type ociTDesc struct {
	MediaType    string            `json:"mediaType"`
	Digest       digest.Digest     `json:"digest"`
	Size         int64             `json:"size"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	Platform     map[string]string `json:"platform,omitempty"`
	ArtifactType string            `json:"artifactType,omitempty"`
	URLs         []string          `json:"urls,omitempty"`
}

type ociTDoc struct {
	SchemaVersion int        `json:"schemaVersion"`
	MediaType     string     `json:"mediaType,omitempty"`
	ArtifactType  string     `json:"artifactType,omitempty"`
	Config        *ociTDesc  `json:"config,omitempty"`
	Layers        []ociTDesc `json:"layers,omitempty"`
	Manifests     []ociTDesc `json:"manifests,omitempty"`
}

func (d ociTDesc) desc() content.Descriptor {
	return content.Descriptor{Digest: d.Digest, Size: d.Size}
}

// pushBlob uploads data and returns its descriptor with media type mt.
func (rg *ociRegistry) pushBlob(t *testing.T, repo, mt string, data []byte) ociTDesc {
	t.Helper()
	r, err := name.NewRepository(rg.host + "/" + repo)
	require.NoError(t, err)
	require.NoError(t, remote.WriteLayer(r, static.NewLayer(data, types.MediaType(mt)), rg.options()...))
	return ociTDesc{MediaType: mt, Digest: digest.FromBytes(data), Size: int64(len(data))}
}

// rawManifest is a manifest to put as it is.
type rawManifest struct {
	body []byte
	mt   string
}

func (m rawManifest) RawManifest() ([]byte, error) { return m.body, nil }

func (m rawManifest) MediaType() (types.MediaType, error) { return types.MediaType(m.mt), nil }

// pushManifest puts a manifest or index under tag (or by digest when tag is
// empty) and returns its descriptor.
func (rg *ociRegistry) pushManifest(t *testing.T, repo, tag, mt string, body []byte) ociTDesc {
	t.Helper()
	d := digest.FromBytes(body)
	refStr := rg.host + "/" + repo + "@" + d.String()
	if tag != "" {
		refStr = rg.host + "/" + repo + ":" + tag
	}
	ref, err := name.ParseReference(refStr)
	require.NoError(t, err)
	require.NoError(t, remote.Put(ref, rawManifest{body, mt}, rg.options()...))
	return ociTDesc{MediaType: mt, Digest: d, Size: int64(len(body))}
}

// ociImage is a pushed test image.
type ociImage struct {
	manifest ociTDesc
	body     []byte
	config   ociTDesc
	layers   []ociTDesc
	data     map[digest.Digest][]byte
}

// pushImage pushes an image of two gzip layers (the first repeated) under
// tag ("" for none) with manifest media type mt (OCI or Docker).
func (rg *ociRegistry) pushImage(t *testing.T, repo, tag, mt, arch string) ociImage {
	t.Helper()
	img := ociImage{data: make(map[digest.Digest][]byte)}
	cfgMT, layerMT := oci.MediaTypeOCIConfig, "application/vnd.oci.image.layer.v1.tar+gzip"
	if mt == oci.MediaTypeDockerManifest {
		cfgMT, layerMT = oci.MediaTypeDockerConfig, "application/vnd.docker.image.rootfs.diff.tar.gzip"
	}
	cfg := fmt.Appendf(nil, `{"architecture":%q,"os":"linux","rootfs":{"type":"layers","diff_ids":[]}}`, arch)
	img.config = rg.pushBlob(t, repo, cfgMT, cfg)
	img.data[img.config.Digest] = cfg
	for i := range 2 {
		layer := sourcetest.Compress(t, source.CompressionGzip, sourcetest.Tar(t, sourcetest.Reg(fmt.Sprintf("file%d-%s", i, arch), strings.Repeat(arch, 3000*(i+1)))))
		d := rg.pushBlob(t, repo, layerMT, layer)
		img.data[d.Digest] = layer
		img.layers = append(img.layers, d)
	}
	doc := ociTDoc{SchemaVersion: 2, MediaType: mt, Config: &img.config, Layers: []ociTDesc{img.layers[0], img.layers[1], img.layers[0]}}
	body, err := json.Marshal(doc)
	require.NoError(t, err)
	img.body = body
	img.manifest = rg.pushManifest(t, repo, tag, mt, body)
	img.data[img.manifest.Digest] = body
	return img
}

// ociRef parses a reference to the test registry.
func ociRef(t *testing.T, host, rest string) ref.Ref {
	t.Helper()
	r, err := ref.Parse("oci://" + host + "/" + rest)
	require.NoError(t, err)
	return r
}

// readAll reads a blob through its opener from off.
func readAll(t *testing.T, o content.RangeOpener, off int64) []byte {
	t.Helper()
	r, err := o.OpenRange(t.Context(), off)
	require.NoError(t, err)
	defer r.Close()
	data, err := io.ReadAll(r)
	require.NoError(t, err)
	return data
}

// assertBlobs checks that every blob of res reads back as data says.
func assertBlobs(t *testing.T, res *source.Resolution, data map[digest.Digest][]byte) {
	t.Helper()
	for d, o := range res.Blobs {
		want, ok := data[d]
		if !assert.True(t, ok, "unexpected blob %s", d) {
			continue
		}
		assert.Equal(t, want, readAll(t, o, 0), "blob %s", d)
	}
}

func TestResolveImage(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	for _, tc := range []struct {
		name   string
		mt     string
		byDig  bool
		repo   string
		tagged bool
	}{
		{"oci by tag", oci.MediaTypeOCIManifest, false, "team/app", true},
		{"docker by tag", oci.MediaTypeDockerManifest, false, "team/docker-app", true},
		{"oci by digest", oci.MediaTypeOCIManifest, true, "pinned", false},
		{"tag and digest", oci.MediaTypeOCIManifest, true, "a/b/c", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img := rg.pushImage(t, tc.repo, "v1", tc.mt, "amd64")
			rest := tc.repo
			if tc.tagged {
				rest += ":v1"
			}
			if tc.byDig {
				rest += "@" + img.manifest.Digest.String()
			}
			src := oci.New(oci.WithPlatform(oci.Platform{OS: "linux", Architecture: "amd64"}))
			res, err := src.Resolve(t.Context(), ociRef(t, rg.host, rest))
			require.NoError(t, err)
			require.NotNil(t, res.Image)
			wantName := rg.host + "/" + tc.repo + ":v1"
			if !tc.tagged {
				wantName = rg.host + "/" + tc.repo + "@" + img.manifest.Digest.String()
			}
			assert.Equal(t, wantName, res.Image.Name)
			assert.Equal(t, source.ImageBlob{Descriptor: img.manifest.desc(), MediaType: tc.mt}, res.Image.Target)
			want := []source.ImageBlob{
				{Descriptor: img.manifest.desc(), MediaType: tc.mt},
				{Descriptor: img.config.desc(), MediaType: img.config.MediaType},
				{Descriptor: img.layers[0].desc(), MediaType: img.layers[0].MediaType},
				{Descriptor: img.layers[1].desc(), MediaType: img.layers[1].MediaType},
			}
			assert.Equal(t, want, res.Image.Blobs)
			assert.Empty(t, res.Model.Files)
			assert.Empty(t, res.Packed)
			if tc.tagged {
				assert.Equal(t, "v1", res.Model.Revision)
			} else {
				assert.Equal(t, img.manifest.Digest.Encoded(), res.Model.Revision)
			}
			assert.NoError(t, content.ValidateModelName(res.Model.Name))
			assert.Equal(t, 4, len(res.Blobs), "openers: manifest, config, two layers")
			assertBlobs(t, res, img.data)
		})
	}
}

func TestResolveIndex(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	for _, indexMT := range []string{oci.MediaTypeOCIIndex, oci.MediaTypeDockerList} {
		repo := "multi/" + map[string]string{oci.MediaTypeOCIIndex: "oci", oci.MediaTypeDockerList: "docker"}[indexMT]
		manifestMT := oci.MediaTypeOCIManifest
		if indexMT == oci.MediaTypeDockerList {
			manifestMT = oci.MediaTypeDockerManifest
		}
		imgs := map[string]ociImage{}
		var entries []ociTDesc
		for _, p := range []struct{ arch, variant string }{{"amd64", ""}, {"arm64", "v8"}, {"arm", "v7"}, {"arm", "v6"}, {"s390x", ""}} {
			img := rg.pushImage(t, repo, "", manifestMT, p.arch+p.variant)
			imgs[p.arch+p.variant] = img
			e := img.manifest
			e.Platform = map[string]string{"os": "linux", "architecture": p.arch}
			if p.variant != "" {
				e.Platform["variant"] = p.variant
			}
			entries = append(entries, e)
		}
		// An attestation manifest, as BuildKit pushes them.
		att := imgs["s390x"].manifest
		att.Platform = map[string]string{"os": "unknown", "architecture": "unknown"}
		entries = append([]ociTDesc{att}, entries...)
		body, err := json.Marshal(ociTDoc{SchemaVersion: 2, MediaType: indexMT, Manifests: entries})
		require.NoError(t, err)
		index := rg.pushManifest(t, repo, "latest", indexMT, body)

		for _, tc := range []struct {
			platform oci.Platform
			want     string
		}{
			{oci.Platform{OS: "linux", Architecture: "amd64"}, "amd64"},
			{oci.Platform{OS: "linux", Architecture: "x86_64"}, "amd64"},
			{oci.Platform{OS: "linux", Architecture: "arm64"}, "arm64v8"},
			{oci.Platform{OS: "linux", Architecture: "aarch64", Variant: "v8"}, "arm64v8"},
			{oci.Platform{OS: "linux", Architecture: "arm", Variant: "v7"}, "armv7"},
			{oci.Platform{OS: "linux", Architecture: "arm", Variant: "v6"}, "armv6"},
			{oci.Platform{OS: "linux", Architecture: "riscv64"}, ""},
			{oci.Platform{OS: "windows", Architecture: "amd64"}, ""},
		} {
			t.Run(indexMT+"/"+tc.platform.String(), func(t *testing.T) {
				t.Parallel()
				src := oci.New(oci.WithPlatform(tc.platform))
				res, err := src.Resolve(t.Context(), ociRef(t, rg.host, repo))
				if tc.want == "" {
					require.Error(t, err)
					assert.ErrorIs(t, err, content.ErrPermanent)
					assert.ErrorIs(t, err, content.ErrNotFound)
					assert.ErrorContains(t, err, "no manifest for")
					assert.ErrorContains(t, err, "linux/arm64/v8")
					return
				}
				require.NoError(t, err)
				img := imgs[tc.want]
				assert.Equal(t, index.desc(), res.Image.Target.Descriptor)
				assert.Equal(t, indexMT, res.Image.Target.MediaType)
				require.Len(t, res.Image.Blobs, 5)
				assert.Equal(t, index.desc(), res.Image.Blobs[0].Descriptor)
				assert.Equal(t, img.manifest.desc(), res.Image.Blobs[1].Descriptor)
				assert.Equal(t, manifestMT, res.Image.Blobs[1].MediaType)
				assert.Equal(t, img.config.desc(), res.Image.Blobs[2].Descriptor)
				assert.Equal(t, rg.host+"/"+repo+":latest", res.Image.Name)
				data := map[digest.Digest][]byte{index.Digest: body}
				for d, b := range img.data {
					data[d] = b
				}
				assertBlobs(t, res, data)
			})
		}
	}
}

// ociModelLayer is one layer of a test model: its media type, its blob and
// the files it holds.
type ociModelLayer struct {
	mt    string
	path  string // the filepath annotation
	blob  []byte
	files map[string]string
}

func modelLayers(t *testing.T) []ociModelLayer {
	archive := sourcetest.Tar(t, sourcetest.Dir("tok/"), sourcetest.Reg("tok/tokenizer.json", `{"v":1}`), sourcetest.Reg("tok/vocab.txt", "a b c"))
	return []ociModelLayer{
		{"application/vnd.cnai.model.weight.v1.raw", "model-00001.safetensors", []byte(strings.Repeat("W", 70000)), map[string]string{"model-00001.safetensors": strings.Repeat("W", 70000)}},
		{"application/vnd.cnai.model.weight.config.v1.raw", "config.json", []byte(`{"arch":"llama"}`), map[string]string{"config.json": `{"arch":"llama"}`}},
		{"application/vnd.cnai.model.doc.v1.raw", "docs/README.md", []byte("# model"), map[string]string{"docs/README.md": "# model"}},
		{"application/vnd.cnai.model.weight.config.v1.tar", "tok", archive, map[string]string{"tok/tokenizer.json": `{"v":1}`, "tok/vocab.txt": "a b c"}},
		{"application/vnd.cnai.model.code.v1.tar+gzip", "run.py", sourcetest.Compress(t, source.CompressionGzip, sourcetest.Tar(t, sourcetest.Reg("run.py", "print()"))), map[string]string{"run.py": "print()"}},
		{"application/vnd.cnai.model.dataset.v1.tar+zstd", "data/eval.jsonl", sourcetest.Compress(t, source.CompressionZstd, sourcetest.Tar(t, sourcetest.Reg("data/eval.jsonl", "{}\n{}\n"))), map[string]string{"data/eval.jsonl": "{}\n{}\n"}},
	}
}

// pushModel pushes a ModelPack artifact marked as a model as how says:
// "v0.0.6" and "v0.0.7" are laid out as those releases of the ModelPack
// spec (github.com/modelpack/model-spec specs-go/v1) have it, the first with
// the cnai media types and filepath annotation, the second with cncf's.
func (rg *ociRegistry) pushModel(t *testing.T, repo, tag, how string, layers []ociModelLayer) ociTDesc {
	t.Helper()
	cfgMT := oci.MediaTypeModelConfig
	pathKey := oci.AnnotationModelFilepath
	doc := ociTDoc{SchemaVersion: 2, MediaType: oci.MediaTypeOCIManifest}
	switch how {
	case "v0.0.6":
		doc.ArtifactType = "application/vnd.cnai.model.manifest.v1+json"
		pathKey = "org.cnai.model.filepath"
	case "v0.0.7":
		doc.ArtifactType = "application/vnd.cncf.model.manifest.v1+json"
		cfgMT = "application/vnd.cncf.model.config.v1+json"
	case "artifactType":
		cfgMT = "application/vnd.oci.empty.v1+json"
		doc.ArtifactType = oci.MediaTypeModelConfig
	case "config":
	case "manifest media type":
		doc.MediaType = oci.MediaTypeModelManifest
		cfgMT = "application/vnd.oci.empty.v1+json"
	case "cncf":
		cfgMT = "application/vnd.cncf.model.config.v1+json"
	}
	cfgBody := []byte(`{"descriptor":{"name":"m"},"modelfs":{"type":"layers","diffIds":[]}}`)
	if strings.HasPrefix(how, "v0.0.") {
		// The spec's ModelConfig: diffIds are the layers' digests, as
		// modctl builds them (raw layers are their own diff).
		var diffIDs []string
		for _, l := range layers {
			diffIDs = append(diffIDs, digest.FromBytes(l.blob).String())
		}
		var err error
		cfgBody, err = json.Marshal(map[string]any{
			"descriptor": map[string]any{"createdAt": "2025-07-21T00:00:00Z", "name": "llama", "family": "llama3", "version": "8b"},
			"config":     map[string]any{"architecture": "transformer", "format": "safetensors", "paramSize": "8b", "precision": "bfloat16"},
			"modelfs":    map[string]any{"type": "layers", "diffIds": diffIDs},
		})
		require.NoError(t, err)
	}
	cfg := rg.pushBlob(t, repo, cfgMT, cfgBody)
	doc.Config = &cfg
	for _, l := range layers {
		d := rg.pushBlob(t, repo, l.mt, l.blob)
		d.Annotations = map[string]string{pathKey: l.path}
		doc.Layers = append(doc.Layers, d)
	}
	body, err := json.Marshal(doc)
	require.NoError(t, err)
	return rg.pushManifest(t, repo, tag, doc.MediaType, body)
}

func TestResolveModel(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	for _, how := range []string{"artifactType", "config", "manifest media type", "cncf", "v0.0.6", "v0.0.7"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			layers := modelLayers(t)
			if how == "cncf" || how == "v0.0.7" {
				for i := range layers {
					layers[i].mt = strings.Replace(layers[i].mt, ".cnai.", ".cncf.", 1)
				}
			}
			slug := strings.ToLower(strings.NewReplacer(" ", "-", ".", "-").Replace(how))
			repo := "models/" + slug + "/llama"
			m := rg.pushModel(t, repo, "v1", how, layers)
			src := oci.New()
			for _, rest := range []string{repo + ":v1", repo + "@" + m.Digest.String()} {
				res, err := src.Resolve(t.Context(), ociRef(t, rg.host, rest))
				require.NoError(t, err, rest)
				assert.Nil(t, res.Image)
				assert.Equal(t, "models."+slug+"/llama", res.Model.Name)
				assert.Equal(t, m.Digest.Encoded(), res.Model.Revision)
				require.NoError(t, res.Model.Validate())

				var paths []string
				for _, f := range res.Model.Files {
					paths = append(paths, f.Path)
				}
				assert.Equal(t, []string{"model-00001.safetensors", "config.json", "docs/README.md"}, paths)
				require.Len(t, res.Packed, 3)
				assert.Equal(t, source.CompressionNone, res.Packed[0].Compression)
				assert.Equal(t, source.CompressionGzip, res.Packed[1].Compression)
				assert.Equal(t, source.CompressionZstd, res.Packed[2].Compression)
				for _, p := range res.Packed {
					assert.True(t, p.Archive)
					assert.Empty(t, p.Path)
				}
				assert.Equal(t, 6, len(res.Blobs), "openers: one per layer")
			}
		})
	}
}

// TestModelIntoCache fetches a model artifact's blobs into a store, as the
// queue does, and unpacks its packed layers.
func TestModelIntoCache(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	layers := modelLayers(t)
	rg.pushModel(t, "models/llama", "v1", "artifactType", layers)
	res, err := oci.New().Resolve(t.Context(), ociRef(t, rg.host, "models/llama:v1"))
	require.NoError(t, err)

	store, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	m := res.Model
	for _, f := range m.Files {
		_, err := store.Fetch(t.Context(), f.Descriptor, res.Blobs[f.Digest], nil)
		require.NoError(t, err)
	}
	for _, l := range res.Packed {
		_, err := store.Fetch(t.Context(), l.Descriptor, res.Blobs[l.Digest], nil)
		require.NoError(t, err)
		f, err := store.Open(l.Digest)
		require.NoError(t, err)
		files, err := prefetch.Unpack(t.Context(), f, l, func(_ string, r io.Reader, size int64) (content.Descriptor, error) {
			info, err := store.Put(t.Context(), r, size)
			return info.Descriptor, err
		})
		f.Close()
		require.NoError(t, err)
		m.Files = append(m.Files, files...)
	}
	want := map[string]string{}
	for _, l := range layers {
		for p, c := range l.files {
			want[p] = c
		}
	}
	require.Len(t, m.Files, len(want))
	for _, f := range m.Files {
		assert.Equal(t, digest.FromString(want[f.Path]), f.Digest, f.Path)
	}
	dir, err := store.Materialize(m)
	require.NoError(t, err)
	for p, c := range want {
		got, err := readFileT(dir, p)
		require.NoError(t, err)
		assert.Equal(t, c, got, p)
	}
}

// patterned returns n bytes in which byte i is i*step (mod 256): offsets
// read back are easy to tell apart.
func patterned(n int, step int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i * step)
	}
	return b
}

func TestBlobRanges(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	data := patterned(100_000, 31)
	d := rg.pushBlob(t, "blobs", "application/octet-stream", data)
	src := oci.New()
	o := src.BlobOpener(agentAuth, rg.host, "blobs", d.desc())
	for _, off := range []int64{0, 1, 4096, 99_999, 100_000} {
		assert.Equal(t, data[off:], readAll(t, o, off), "offset %d", off)
	}
	b, ok := o.(interface {
		OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error)
	})
	require.True(t, ok)
	for _, r := range [][2]int64{{0, 10}, {500, 16384}, {99_000, 1000}, {5, 0}} {
		rc, err := b.OpenBoundedRange(t.Context(), r[0], r[1])
		require.NoError(t, err)
		got, err := io.ReadAll(rc)
		rc.Close()
		require.NoError(t, err)
		assert.Equal(t, data[r[0]:r[0]+r[1]], got, "range %v", r)
	}
	_, err := o.OpenRange(t.Context(), 100_001)
	assert.ErrorIs(t, err, content.ErrPermanent)
	_, err = b.OpenBoundedRange(t.Context(), 99_999, 2)
	assert.ErrorIs(t, err, content.ErrPermanent)

	size, err := src.BlobSize(t.Context(), agentAuth, rg.host, "blobs", d.Digest)
	require.NoError(t, err)
	assert.Equal(t, int64(len(data)), size)
	_, err = src.BlobSize(t.Context(), agentAuth, rg.host, "blobs", digest.FromString("absent"))
	assert.ErrorIs(t, err, content.ErrNotFound)
	_, err = src.BlobOpener(agentAuth, rg.host, "blobs", content.Descriptor{Digest: digest.FromString("absent"), Size: 6}).OpenRange(t.Context(), 0)
	assert.ErrorIs(t, err, content.ErrNotFound)
	assert.ErrorIs(t, err, content.ErrPermanent)
}

// BlobStart brings a short blob whole, and the size and first bytes of a
// long one, in one request each, also from a registry that ignores Range.
func TestBlobStart(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	long := patterned(100_000, 7)
	short := long[:1000]
	dl := rg.pushBlob(t, "blobs", "application/octet-stream", long)
	ds := rg.pushBlob(t, "blobs", "application/octet-stream", short)
	var requests atomic.Int32
	for _, ranges := range []bool{true, false} {
		rg.setFault(func(w http.ResponseWriter, r *http.Request, next http.Handler) {
			if r.URL.Path != "/v2/" {
				requests.Add(1)
			}
			if !ranges {
				r.Header.Del("Range")
			}
			next.ServeHTTP(w, r)
		})
		src := oci.New()
		for _, c := range []struct {
			d    ociTDesc
			n    int64
			want []byte
		}{
			{ds, 4096, short},
			{ds, 1000, short},
			{ds, 999, short[:999]},
			{dl, 4096, long[:4096]},
		} {
			requestsWanted := int32(1)
			if !ranges && c.d.Size > c.n {
				c.want = nil // the whole blob is not read
			}
			if ranges && c.n > c.d.Size {
				// go-containerregistry's registry refuses a range past the
				// end (416): the first byte is asked for next.
				c.want, requestsWanted = c.want[:1], 2
			}
			before := requests.Load()
			size, start, err := src.BlobStart(t.Context(), agentAuth, rg.host, "blobs", c.d.Digest, c.n)
			require.NoError(t, err)
			assert.Equal(t, c.d.Size, size)
			assert.Equal(t, c.want, start, "the first %d bytes of %d (ranges %v)", c.n, c.d.Size, ranges)
			assert.Equal(t, requestsWanted, requests.Load()-before)
		}
		_, _, err := src.BlobStart(t.Context(), agentAuth, rg.host, "blobs", digest.FromString("absent"), 10)
		assert.ErrorIs(t, err, content.ErrNotFound)
	}
}

func TestManifestForMirror(t *testing.T) {
	t.Parallel()
	rg := newOCIRegistry(t)
	img := rg.pushImage(t, "mirror/app", "v2", oci.MediaTypeDockerManifest, "amd64")
	src := oci.New()
	for _, ref := range []string{"v2", img.manifest.Digest.String()} {
		mt, body, d, err := src.Manifest(t.Context(), agentAuth, rg.host, "mirror/app", ref)
		require.NoError(t, err)
		assert.Equal(t, oci.MediaTypeDockerManifest, mt)
		assert.Equal(t, img.body, body)
		assert.Equal(t, img.manifest.Digest, d)
	}
	_, _, _, err := src.Manifest(t.Context(), agentAuth, rg.host, "mirror/app", "nope")
	assert.ErrorIs(t, err, content.ErrNotFound)
	_, _, _, err = src.Manifest(t.Context(), agentAuth, rg.host, "mirror/absent", "v2")
	assert.ErrorIs(t, err, content.ErrNotFound)
	for _, bad := range [][2]string{{"mirror/app", "sha256:zz"}, {"Mirror/App", "v2"}, {"mirror/app", "-x"}} {
		_, _, _, err = src.Manifest(t.Context(), agentAuth, rg.host, bad[0], bad[1])
		assert.ErrorIs(t, err, content.ErrInvalid, "%v", bad)
	}
}

func TestUnsupported(t *testing.T) {
	t.Parallel()
	_, err := oci.New().Resolve(t.Context(), ref.Ref{Kind: ref.KindHF, Repository: "a/b", Revision: "main"})
	assert.ErrorIs(t, err, content.ErrPermanent)
}

func readFileT(dir, p string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(p)))
	return string(b), err
}

// Short requests (here a blob's first bytes) find the connection the last
// one left idle, even while blob reads hold every other connection: they
// dial no new one behind a full link.
func TestShortRequestsKeepTheirConnections(t *testing.T) {
	t.Parallel()
	var dials atomic.Int32
	release := make(chan struct{})
	next := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.Header.Get("Range"), "bytes=100-") && strings.Contains(r.UserAgent(), "weightd/") {
			w.Header().Set("Content-Range", "bytes 100-4095/4096")
			w.WriteHeader(http.StatusPartialContent)
			_, _ = w.Write(make([]byte, 10))
			w.(http.Flusher).Flush()
			select { // a blob read that streams slowly
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		next.ServeHTTP(w, r)
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			dials.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	defer close(release)
	rg := &ociRegistry{host: strings.TrimPrefix(srv.URL, "http://")}
	d := rg.pushBlob(t, "team/app", "application/octet-stream", []byte(strings.Repeat("b", 4096)))
	src := oci.New(oci.WithTransport(http.DefaultTransport.(*http.Transport).Clone()))
	_, _, err := src.BlobStart(t.Context(), agentAuth, rg.host, "team/app", d.Digest, 10)
	require.NoError(t, err)
	for range 3 {
		r, err := src.BlobOpener(agentAuth, rg.host, "team/app", d.desc()).OpenRange(t.Context(), 100)
		require.NoError(t, err)
		defer r.Close()
	}
	before := dials.Load()
	_, _, err = src.BlobStart(t.Context(), agentAuth, rg.host, "team/app", d.Digest, 10)
	require.NoError(t, err)
	assert.Equal(t, before, dials.Load(), "no new connection for a short request")
}

// FuzzBlobStart answers BlobStart with arbitrary statuses, Content-Range
// and Content-Length headers and bodies: errors, never panics, and what
// it accepts is a size no shorter than the bytes it returns, at most n of
// them, which are the front of what the registry sent.
func FuzzBlobStart(f *testing.F) {
	f.Add(uint8(1), "bytes 0-9/100", "10", []byte("0123456789"), int64(10))
	f.Add(uint8(1), "bytes 0-4/5", "5", []byte("01234"), int64(10))
	f.Add(uint8(0), "", "5", []byte("01234"), int64(10))
	f.Add(uint8(0), "", "100", []byte("0123456789"), int64(10))
	f.Add(uint8(1), "bytes 5-9/100", "5", []byte("56789"), int64(10))
	f.Add(uint8(1), "bytes 0-20/10", "21", []byte("0123456789"), int64(30))
	f.Add(uint8(2), "bytes */0", "0", []byte{}, int64(1))
	type answer struct {
		status                 int
		contentRange, declared string
		body                   []byte
	}
	var next atomic.Pointer[answer]
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v2/" {
			return
		}
		a := next.Load()
		if a.contentRange != "" {
			w.Header().Set("Content-Range", a.contentRange)
		}
		w.Header().Set("Content-Length", a.declared)
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
	}))
	f.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	d := digest.FromString("blob")
	src := oci.New()
	statuses := []int{http.StatusOK, http.StatusPartialContent, http.StatusRequestedRangeNotSatisfiable, http.StatusNotFound, http.StatusInternalServerError}
	f.Fuzz(func(t *testing.T, status uint8, contentRange, declared string, body []byte, n int64) {
		if len(body) > 1<<16 || n > 1<<20 || strings.ContainsAny(contentRange+declared, "\r\n\x00") {
			return
		}
		next.Store(&answer{status: statuses[int(status)%len(statuses)], contentRange: contentRange, declared: declared, body: body})
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		size, start, err := src.BlobStart(ctx, agentAuth, host, "fuzz/blob", d, n)
		if ctx.Err() != nil {
			t.Fatalf("BlobStart hung: %v", err)
		}
		if err != nil {
			return
		}
		if size < 0 || int64(len(start)) > size || int64(len(start)) > n || !bytes.HasPrefix(body, start) {
			t.Fatalf("accepted size %d and %d bytes for the first %d, from %d bytes sent", size, len(start), n, len(body))
		}
	})
}
