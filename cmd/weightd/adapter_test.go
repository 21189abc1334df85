package main

import (
	"context"
	"fmt"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
)

// fakeAdapters answers POST /v1/adapters from a table.
type fakeAdapters struct {
	mu  sync.Mutex
	got []api.AdapterRequest
}

func (f *fakeAdapters) Ensure(_ context.Context, req api.AdapterRequest) (api.AdapterAnswer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, req)
	switch req.Base {
	case "hf://org/base@main":
		return api.AdapterAnswer{Server: "ai/warm-0", Endpoint: "http://10.0.0.7:8000", Model: "sql", Loaded: len(f.got) == 1, Seconds: 0.012}, nil
	case "hf://org/full@main":
		return api.AdapterAnswer{}, fmt.Errorf("%w: every slot holds an adapter in use", api.ErrBusy)
	}
	return api.AdapterAnswer{}, fmt.Errorf("%w: no warm server of base %s", api.ErrNotFound, req.Base)
}

func TestAdapterEnsureCommand(t *testing.T) {
	t.Parallel()
	store, err := cache.Open(filepath.Join(t.TempDir(), "cache"))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	fake := &fakeAdapters{}
	h, err := api.NewServer(api.QueueJobs(prefetch.NewQueue(store, source.Sources{})), store, api.WithAdapters(fake))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	addr := "tcp://" + strings.TrimPrefix(srv.URL, "http://")

	code, out, errOut := runCLI(t, "adapter", "ensure", "hf://org/base@main", "hf://org/sql-lora@main", "--name", "sql", "--pin", "--api", addr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if want := "server ai/warm-0\nendpoint http://10.0.0.7:8000\nmodel sql\n"; out != want || !strings.Contains(errOut, "loaded in") {
		t.Fatalf("stdout %q, stderr %q", out, errOut)
	}
	if got := fake.got[0]; got != (api.AdapterRequest{Base: "hf://org/base@main", Ref: "hf://org/sql-lora@main", Name: "sql", Pin: true}) {
		t.Fatalf("request %+v", got)
	}
	code, out, errOut = runCLI(t, "adapter", "ensure", "hf://org/base@main", "hf://org/sql-lora@main", "--json", "--api", addr)
	if code != 0 || !strings.Contains(out, `"model": "sql"`) || !strings.Contains(out, `"loaded": false`) {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	for base, want := range map[string]string{"hf://org/full@main": "busy", "hf://org/none@main": "no warm server"} {
		code, _, errOut = runCLI(t, "adapter", "ensure", base, "hf://org/x@main", "--api", addr)
		if code != 1 || !strings.Contains(errOut, want) {
			t.Errorf("%s: exit %d, stderr %q", base, code, errOut)
		}
	}
}
