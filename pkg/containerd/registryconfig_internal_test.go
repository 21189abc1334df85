package containerd

import (
	"maps"
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
)

// The "config" entries of real daemons' verbose CRI Status, cut down:
// 1.6's holds the registry, 2.4's the runtime config alone.
const (
	config16 = `{"containerd":{"snapshotter":"overlayfs","discardUnpackedLayers":false},` +
		`"registry":{"configPath":"/etc/containerd/certs.d","mirrors":{"docker.io":{"endpoint":["https://registry-1.docker.io"]},"quay.io":{"endpoint":[]}},"configs":null,"auths":null,"headers":null},` +
		`"disableTCPService":true,"containerdRootDir":"/var/lib/containerd"}`
	config24 = `{"containerd":{"defaultRuntimeName":"runc"},"cni":{"binDir":""},"enableSelinux":false,` +
		`"containerdRootDir":"/var/lib/containerd","containerdEndpoint":"/run/containerd/containerd.sock"}`
)

// statusResponse encodes a StatusResponse: a RuntimeStatus, the info map
// in order, runtime handlers.
func statusResponse(info ...[2]string) []byte {
	status := protowire.AppendTag(nil, 1, protowire.BytesType)
	status = protowire.AppendString(status, "RuntimeReady")
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, status)
	for _, kv := range info {
		var e []byte
		e = protowire.AppendTag(e, 1, protowire.BytesType)
		e = protowire.AppendString(e, kv[0])
		e = protowire.AppendTag(e, 2, protowire.BytesType)
		e = protowire.AppendString(e, kv[1])
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, e)
	}
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	b = protowire.AppendString(b, "runc")
	return b
}

func TestParseCRIStatusInfo(t *testing.T) {
	t.Parallel()
	info, err := parseCRIStatusInfo(statusResponse([2]string{"golang", `"go1.20"`}, [2]string{"config", config16}, [2]string{"lastCNILoadStatus", "OK"}))
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"golang": `"go1.20"`, "config": config16, "lastCNILoadStatus": "OK"}, info)

	info, err = parseCRIStatusInfo(statusResponse([2]string{"config", "old"}, [2]string{"config", "new"}))
	require.NoError(t, err)
	assert.Equal(t, "new", info["config"], "the last value of a key wins")

	info, err = parseCRIStatusInfo(nil)
	require.NoError(t, err)
	assert.Empty(t, info)

	whole := statusResponse([2]string{"config", config16})
	_, err = parseCRIStatusInfo(whole[:len(whole)-10])
	assert.Error(t, err, "a truncated answer")

	var many [][2]string
	for i := range maxStatusInfo + 1 {
		many = append(many, [2]string{"k" + strconv.Itoa(i), "v"})
	}
	_, err = parseCRIStatusInfo(statusResponse(many...))
	assert.ErrorContains(t, err, "entries")
}

func TestParseCRIConfig(t *testing.T) {
	t.Parallel()
	path, mirrors, ok, err := parseCRIConfig(config16)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "/etc/containerd/certs.d", path)
	assert.Equal(t, []string{"docker.io", "quay.io"}, mirrors)

	_, _, ok, err = parseCRIConfig(config24)
	require.NoError(t, err)
	assert.False(t, ok, "2.x reports no registry")

	path, mirrors, ok, err = parseCRIConfig(`{"registry":{"configPath":""}}`)
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Empty(t, path)
	assert.Empty(t, mirrors)

	_, _, ok, err = parseCRIConfig("")
	require.NoError(t, err)
	assert.False(t, ok)

	for _, bad := range []string{"{", `{"registry":{"configPath":3}}`, `{"registry":[]}`, "null x"} {
		_, _, _, err = parseCRIConfig(bad)
		assert.Error(t, err, bad)
	}
}

// FuzzParseCRIStatus checks the parsers of a CRI Status answer, which
// comes from whatever listens on containerd's socket, on any input: they
// never panic, a decoded info map encodes back to one that decodes the
// same, and a registry config found is a clean answer.
func FuzzParseCRIStatus(f *testing.F) {
	f.Add(statusResponse([2]string{"config", config16}, [2]string{"golang", `"go1.20"`}))
	f.Add(statusResponse([2]string{"config", config24}))
	f.Add(statusResponse([2]string{"config", `{"registry":{"configPath":"a:b:"}}`}))
	f.Add(statusResponse())
	f.Add([]byte{0x12, 0x05, 0x0a, 0x01, 'k', 0x12, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		info, err := parseCRIStatusInfo(b)
		if err != nil {
			if info != nil {
				t.Fatalf("an error (%v) with an info map", err)
			}
			return
		}
		if len(info) > maxStatusInfo {
			t.Fatalf("%d entries", len(info))
		}
		var kvs [][2]string
		for _, k := range slices.Sorted(maps.Keys(info)) {
			kvs = append(kvs, [2]string{k, info[k]})
		}
		again, err := parseCRIStatusInfo(statusResponse(kvs...))
		if err != nil || !maps.Equal(info, again) {
			t.Fatalf("re-encoded: %v, %v != %v", err, again, info)
		}
		path, mirrors, ok, err := parseCRIConfig(info["config"])
		if err != nil || !ok {
			if path != "" || mirrors != nil {
				t.Fatalf("no registry config (%v), yet %q %q", err, path, mirrors)
			}
			return
		}
		if !slices.IsSorted(mirrors) {
			t.Fatalf("mirrors not sorted: %q", mirrors)
		}
	})
}

// FuzzParseCRIConfig checks the CRI config JSON parser on any input.
func FuzzParseCRIConfig(f *testing.F) {
	for _, s := range []string{config16, config24, "", "{}", `{"registry":null}`, `{"Registry":{"ConfigPath":"x"}}`, `{"registry":{"mirrors":{"":{}}}}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		path, mirrors, ok, err := parseCRIConfig(s)
		if (err != nil || !ok) && (path != "" || mirrors != nil) {
			t.Fatalf("no registry config (%v), yet %q %q", err, path, mirrors)
		}
		if err != nil && ok {
			t.Fatal("ok with an error")
		}
		if !slices.IsSorted(mirrors) {
			t.Fatalf("mirrors not sorted: %q", mirrors)
		}
	})
}
