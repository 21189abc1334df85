package oci_test

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/oci"
)

// A ModelPack model in a registry resolves to its files: a raw layer is a
// file, a tar layer is unpacked.
func ExampleSource_Resolve() {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")

	// Push a model: its config, a raw weights layer and a tar of its
	// tokenizer.
	repo, _ := name.NewRepository(host + "/models/tiny")
	push := func(mt string, data []byte) string {
		if err := remote.WriteLayer(repo, static.NewLayer(data, types.MediaType(mt))); err != nil {
			log.Fatal(err)
		}
		return fmt.Sprintf(`{"mediaType":%q,"digest":%q,"size":%d`, mt, digest.FromBytes(data), len(data))
	}
	var tarball bytes.Buffer
	tw := tar.NewWriter(&tarball)
	tw.WriteHeader(&tar.Header{Name: "tokenizer.json", Mode: 0o644, Size: 2})
	tw.Write([]byte("{}"))
	tw.Close()
	manifest := `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",` +
		`"artifactType":"application/vnd.cnai.model.config.v1+json",` +
		`"config":` + push("application/vnd.cnai.model.config.v1+json", []byte(`{}`)) + `},` +
		`"layers":[` + push("application/vnd.cnai.model.weight.v1.raw", []byte("weights")) +
		`,"annotations":{"org.cncf.model.filepath":"model.safetensors"}},` +
		push("application/vnd.cnai.model.weight.config.v1.tar", tarball.Bytes()) + `}]}`
	tag, _ := name.NewTag(host + "/models/tiny:v1")
	if err := remote.Put(tag, rawManifest{[]byte(manifest), oci.MediaTypeOCIManifest}); err != nil {
		log.Fatal(err)
	}

	parsed, err := ref.Parse("oci://" + host + "/models/tiny:v1")
	if err != nil {
		log.Fatal(err)
	}
	res, err := oci.New().Resolve(context.Background(), parsed)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("model:", res.Model.Name)
	for _, f := range res.Model.Files {
		fmt.Println("file:", f.Path, f.Size)
	}
	for _, l := range res.Packed {
		r, _ := res.Blobs[l.Digest].OpenRange(context.Background(), 0)
		files, err := prefetch.Unpack(context.Background(), r, l, func(_ string, r io.Reader, _ int64) (content.Descriptor, error) {
			data, err := io.ReadAll(r)
			return content.Descriptor{Digest: digest.FromBytes(data), Size: int64(len(data))}, err
		})
		r.Close()
		if err != nil {
			log.Fatal(err)
		}
		for _, f := range files {
			fmt.Println("unpacked:", f.Path, f.Size)
		}
	}
	// Output:
	// model: models/tiny
	// file: model.safetensors 7
	// unpacked: tokenizer.json 2
}
