package mirror_test

import (
	"context"
	"fmt"
	"io"
	"net/http/httptest"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/mirror"
	"github.com/weightd/weightd/pkg/source/oci"
)

// noUpstream is an upstream registry that has nothing.
type noUpstream struct{}

func (noUpstream) Manifest(context.Context, oci.RegistryAuth, string, string, string) (string, []byte, digest.Digest, error) {
	return "", nil, "", content.ErrNotFound
}

func (noUpstream) BlobSize(context.Context, oci.RegistryAuth, string, string, digest.Digest) (int64, error) {
	return 0, content.ErrNotFound
}

func (noUpstream) BlobStart(context.Context, oci.RegistryAuth, string, string, digest.Digest, int64) (int64, []byte, error) {
	return 0, nil, content.ErrNotFound
}

func (noUpstream) BlobOpener(oci.RegistryAuth, string, string, content.Descriptor) content.RangeOpener {
	return nil
}

// The agent serves the mirror on loopback and points containerd's pulls
// from docker.io at it.
func Example() {
	dir, _ := os.MkdirTemp("", "weightd-example")
	defer os.RemoveAll(dir)
	store, err := cache.Open(filepath.Join(dir, "cache"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	m, err := mirror.New(store, noUpstream{}, mirror.WithRegistries("docker.io"), mirror.WithStateDir(filepath.Join(dir, "state")))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Close()
	srv := httptest.NewServer(m) // the agent: an http.Server on 127.0.0.1:5001
	defer srv.Close()

	hostsDir := filepath.Join(dir, "certs.d") // containerd's registry config_path
	if err := mirror.ConfigureHosts(hostsDir, srv.URL, []string{"docker.io"}); err != nil {
		fmt.Println(err)
		return
	}
	b, _ := os.ReadFile(filepath.Join(hostsDir, "docker.io", "hosts.toml"))
	fmt.Println(string(b[:len("# Written by weightd")]))

	resp, err := srv.Client().Get(srv.URL + "/v2/library/busybox/manifests/latest?ns=docker.io")
	if err != nil {
		fmt.Println(err)
		return
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(resp.StatusCode, string(body))

	if err := mirror.RestoreHosts(hostsDir, []string{"docker.io"}); err != nil {
		fmt.Println(err)
	}
	// Output:
	// # Written by weightd
	// 404 {"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}
}
