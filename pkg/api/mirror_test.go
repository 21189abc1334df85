package api

import (
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

func TestStatusShowsMirror(t *testing.T) {
	t.Parallel()
	want := MirrorStatus{
		Addr: "127.0.0.1:5001", Registries: []string{"docker.io"}, HostsDir: "/etc/containerd/certs.d",
		ConfigPathState: ConfigPathUnset, ContainerdVersion: "1.6.20", Problem: "containerd reads no hosts.toml",
	}
	_, c := newTestServer(t, newFakeJobs(), WithMirror(func() MirrorStatus { return want }))
	st, err := c.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.Mirror == nil || !reflect.DeepEqual(*st.Mirror, want) {
		t.Fatalf("mirror %+v, want %+v", st.Mirror, want)
	}

	// Without a mirror the status has no "mirror" key at all.
	ts, c := newTestServer(t, newFakeJobs())
	st, err = c.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.Mirror != nil {
		t.Fatalf("mirror %+v without WithMirror", st.Mirror)
	}
	resp, err := http.Get(ts.URL + "/v1/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(body), `"mirror"`) {
		t.Fatalf("status without a mirror: %s", body)
	}
}
