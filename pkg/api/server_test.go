package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// fakeJobs is a Jobs whose behaviour each test sets; it knows the jobs in
// status and streams, for a watch, what the test sends on updates.
type fakeJobs struct {
	mu         sync.Mutex
	status     map[string]prefetch.JobStatus
	updates    chan prefetch.JobStatus // what watches stream after the first status; closing it ends them
	watchEnded chan struct{}           // receives once per watch that has ended
}

func newFakeJobs() *fakeJobs {
	return &fakeJobs{status: make(map[string]prefetch.JobStatus), watchEnded: make(chan struct{}, 8)}
}

func (f *fakeJobs) Submit(reference string, p prefetch.Priority) (prefetch.JobStatus, error) {
	r, err := ref.Parse(reference)
	if err != nil {
		return prefetch.JobStatus{}, err
	}
	if strings.Contains(reference, "stopped") {
		return prefetch.JobStatus{}, prefetch.ErrQueueStopped
	}
	st := prefetch.JobStatus{ID: "j1", Ref: r.Redacted(), State: prefetch.StateQueued, Priority: p, Created: time.Now()}
	f.mu.Lock()
	f.status[st.ID] = st
	f.mu.Unlock()
	return st, nil
}

func (f *fakeJobs) Cancel(id string) (prefetch.JobStatus, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.status[id]
	if ok && !st.State.Finished() {
		st.State, st.Error = prefetch.StateFailed, prefetch.ErrCanceled.Error()
		f.status[id] = st
	}
	return st, ok
}

func (f *fakeJobs) Status(id string) (prefetch.JobStatus, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.status[id]
	return st, ok
}

func (f *fakeJobs) Watch(ctx context.Context, id string) (<-chan prefetch.JobStatus, bool) {
	st, ok := f.Status(id)
	if !ok {
		return nil, false
	}
	ch := make(chan prefetch.JobStatus)
	go func() {
		defer close(ch)
		defer func() { f.watchEnded <- struct{}{} }()
		select {
		case ch <- st:
		case <-ctx.Done():
			return
		}
		for {
			select {
			case u, ok := <-f.updates:
				if !ok {
					return
				}
				select {
				case ch <- u:
				case <-ctx.Done():
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	return ch, true
}

func (f *fakeJobs) List() []prefetch.JobStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []prefetch.JobStatus
	for _, st := range f.status {
		out = append(out, st)
	}
	return out
}

type fakeUsage cache.Usage

func (u fakeUsage) Usage() cache.Usage { return cache.Usage(u) }

func newTestServer(t *testing.T, jobs Jobs, opts ...Option) (*httptest.Server, *Client) {
	t.Helper()
	s, err := NewServer(jobs, fakeUsage{Root: "/cache", Bytes: 42, Blobs: 1}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	c, err := NewClient(ts.URL)
	if err != nil {
		t.Fatal(err)
	}
	return ts, c
}

func TestSubmit(t *testing.T) {
	t.Parallel()
	ts, _ := newTestServer(t, newFakeJobs())
	tests := []struct {
		name     string
		body     string
		code     int
		errorHas string
	}{
		{"ok", `{"ref":"https://example.com/m/model.json"}`, http.StatusAccepted, ""},
		{"bad ref", `{"ref":"ftp://example.com/x"}`, http.StatusBadRequest, "unsupported scheme"},
		{"digest fragment not sha256", `{"ref":"https://example.com/f#md5:00"}`, http.StatusBadRequest, "sha256"},
		{"missing ref", `{}`, http.StatusBadRequest, "missing field ref"},
		{"bad json", `{"ref":`, http.StatusBadRequest, "decoding request body"},
		{"not an object", `["x"]`, http.StatusBadRequest, "decoding request body"},
		{"unknown field", `{"ref":"https://example.com/m.json","prio":"pod"}`, http.StatusBadRequest, "unknown field"},
		{"priority", `{"ref":"https://example.com/m.json","priority":"pod"}`, http.StatusAccepted, ""},
		{"bad priority", `{"ref":"https://example.com/m.json","priority":"urgent"}`, http.StatusBadRequest, "want background, normal or pod"},
		{"priority not a string", `{"ref":"https://example.com/m.json","priority":1}`, http.StatusBadRequest, "decoding request body"},
		{"trailing data", `{"ref":"https://example.com/m.json"} {}`, http.StatusBadRequest, "data after"},
		{"huge body", `{"ref":"https://example.com/` + strings.Repeat("a", MaxBodyBytes) + `"}`, http.StatusRequestEntityTooLarge, "over 1048576 bytes"},
		{"queue stopped", `{"ref":"https://example.com/stopped.json"}`, http.StatusServiceUnavailable, "stopped"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, err := http.Post(ts.URL+"/v1/fetch", "application/json", strings.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tt.code {
				t.Fatalf("status %d, want %d; body %s", resp.StatusCode, tt.code, body)
			}
			if got := resp.Header.Get("Content-Type"); got != "application/json" {
				t.Errorf("content type %q", got)
			}
			if tt.errorHas != "" && (!strings.Contains(string(body), `"error":`) || !strings.Contains(string(body), tt.errorHas)) {
				t.Errorf("body %.200s, want an error with %q", body, tt.errorHas)
			}
		})
	}
}

func TestClientErrors(t *testing.T) {
	t.Parallel()
	_, c := newTestServer(t, newFakeJobs())
	ctx := t.Context()

	_, err := c.Fetch(ctx, "not a url")
	var apiErr *Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest || !strings.Contains(apiErr.Message, "parsing reference") {
		t.Fatalf("Fetch(bad ref) = %v, want a 400 carrying the server's message", err)
	}

	_, err = c.Job(ctx, "nope")
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `no job "nope"`) {
		t.Fatalf("Job(unknown) = %v, want ErrNotFound with the server's message", err)
	}
	_, err = c.Watch(ctx, "nope", nil)
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("Watch(unknown) = %v, want ErrNotFound", err)
	}
	_, err = c.Cancel(ctx, "nope")
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("Cancel(unknown) = %v, want ErrNotFound", err)
	}
	st, err := c.Submit(ctx, FetchRequest{Ref: "https://example.com/m.json", Priority: "pod"})
	if err != nil || st.Priority != prefetch.PriorityPod {
		t.Fatalf("Submit at pod priority = %+v, %v", st, err)
	}
	st, err = c.Cancel(ctx, st.ID)
	if err != nil || st.State != prefetch.StateFailed || st.Error != prefetch.ErrCanceled.Error() {
		t.Fatalf("Cancel = %+v, %v, want the job failed as cancelled", st, err)
	}
	err = c.do(ctx, http.MethodGet, "/v2/nothing", nil, nil)
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "GET /v2/nothing: not found") {
		t.Fatalf("unknown route = %v, want a JSON 404", err)
	}
	err = c.do(ctx, http.MethodDelete, "/v1/status", nil, nil)
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusMethodNotAllowed || apiErr.Message != "DELETE /v1/status: method not allowed" {
		t.Fatalf("DELETE /v1/status = %v, want 405", err)
	}
}

func TestFetchJobListStatus(t *testing.T) {
	t.Parallel()
	_, c := newTestServer(t, newFakeJobs(), WithVersion("v1.2.3"))
	ctx := t.Context()
	st, err := c.Fetch(ctx, "https://example.com/m/model.json?X-Amz-Signature=secret")
	if err != nil {
		t.Fatal(err)
	}
	if st.ID != "j1" || st.State != prefetch.StateQueued || strings.Contains(st.Ref, "secret") {
		t.Fatalf("Fetch = %+v", st)
	}
	got, err := c.Job(ctx, st.ID)
	if err != nil || got.ID != st.ID {
		t.Fatalf("Job = %+v, %v", got, err)
	}
	list, err := c.Jobs(ctx)
	if err != nil || len(list) != 1 {
		t.Fatalf("Jobs = %+v, %v", list, err)
	}
	status, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if status.Version != "v1.2.3" || status.Cache.Bytes != 42 || status.Cache.Root != "/cache" || len(status.Jobs) != 1 {
		t.Fatalf("Status = %+v", status)
	}
}

func TestEmptyListIsArray(t *testing.T) {
	t.Parallel()
	ts, _ := newTestServer(t, newFakeJobs())
	for _, path := range []string{"/v1/fetch", "/v1/status"} {
		resp, err := http.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(body), "null") {
			t.Errorf("GET %s = %s: an empty list must be [], not null", path, body)
		}
	}
}

func TestWatchStreamsUntilJobEnds(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	jobs.updates = make(chan prefetch.JobStatus)
	ts, c := newTestServer(t, jobs)
	st, err := c.Fetch(t.Context(), "https://example.com/m/model.json")
	if err != nil {
		t.Fatal(err)
	}

	go func() {
		for i := int64(1); i <= 3; i++ {
			jobs.updates <- prefetch.JobStatus{ID: st.ID, State: prefetch.StateFetching, BytesDone: i * 10, BytesTotal: 30}
		}
		jobs.updates <- prefetch.JobStatus{ID: st.ID, State: prefetch.StateReady, BytesDone: 30, BytesTotal: 30, Dir: "/cache/models/x"}
		close(jobs.updates)
	}()
	var seen []prefetch.JobStatus
	final, err := c.Watch(t.Context(), st.ID, func(s prefetch.JobStatus) { seen = append(seen, s) })
	if err != nil {
		t.Fatal(err)
	}
	if final.State != prefetch.StateReady || final.Dir != "/cache/models/x" {
		t.Fatalf("final = %+v", final)
	}
	if len(seen) != 5 || seen[0].State != prefetch.StateQueued || seen[2].BytesDone != 20 {
		t.Fatalf("seen %d statuses: %+v", len(seen), seen)
	}

	// The stream is NDJSON.
	resp, err := http.Get(ts.URL + "/v1/fetch/" + st.ID + "/watch")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "application/x-ndjson" {
		t.Errorf("watch content type %q", ct)
	}
}

func TestWatchEndsBeforeJobIsAnError(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	jobs.updates = make(chan prefetch.JobStatus)
	close(jobs.updates) // the stream ends after the first (queued) status
	_, c := newTestServer(t, jobs)
	st, err := c.Fetch(t.Context(), "https://example.com/m/model.json")
	if err != nil {
		t.Fatal(err)
	}
	last, err := c.Watch(t.Context(), st.ID, nil)
	if err == nil || !strings.Contains(err.Error(), `stream ended in state "queued"`) || last.State != prefetch.StateQueued {
		t.Fatalf("Watch = %+v, %v; want an error saying the job had not ended", last, err)
	}
}

func TestWatchStopsOnClientDisconnect(t *testing.T) {
	t.Parallel()
	jobs := newFakeJobs()
	jobs.updates = make(chan prefetch.JobStatus) // never sends: the job never ends
	_, c := newTestServer(t, jobs)
	st, err := c.Fetch(t.Context(), "https://example.com/m/model.json")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	first := make(chan struct{})
	errc := make(chan error, 1)
	go func() {
		var once sync.Once
		_, err := c.Watch(ctx, st.ID, func(prefetch.JobStatus) { once.Do(func() { close(first) }) })
		errc <- err
	}()
	<-first // the stream is established and its first line delivered
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Watch after cancel = %v, want context.Canceled", err)
	}
	select {
	case <-jobs.watchEnded:
	case <-time.After(5 * time.Second):
		t.Fatal("the server kept watching after the client went away")
	}
}

func TestHealthAndReadiness(t *testing.T) {
	t.Parallel()
	ready := errors.New("queue not running")
	var mu sync.Mutex
	_, c := newTestServer(t, newFakeJobs(), WithReadiness(func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		return ready
	}))
	ctx := t.Context()
	if err := c.do(ctx, http.MethodGet, "/healthz", nil, nil); err != nil {
		t.Fatalf("healthz: %v", err)
	}
	err := c.Ready(ctx)
	var apiErr *Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusServiceUnavailable || apiErr.Message != "queue not running" {
		t.Fatalf("readyz while not ready = %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := c.WaitReady(short); err == nil || !strings.Contains(err.Error(), "queue not running") {
		t.Fatalf("WaitReady while not ready = %v", err)
	}
	time.AfterFunc(50*time.Millisecond, func() {
		mu.Lock()
		defer mu.Unlock()
		ready = nil
	})
	if err := c.WaitReady(ctx); err != nil {
		t.Fatalf("WaitReady: %v", err)
	}
	if err := c.Ready(ctx); err != nil {
		t.Fatalf("readyz when ready: %v", err)
	}
}

func TestRequestMetrics(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	_, c := newTestServer(t, newFakeJobs(), WithRegisterer(reg))
	ctx := t.Context()
	_, _ = c.Job(ctx, "nope")
	_, _ = c.Status(ctx)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "weightd_api_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var route, code string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "route":
					route = l.GetValue()
				case "code":
					code = l.GetValue()
				}
			}
			got[route+" "+code] = m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{"GET /v1/fetch/{id} 404": 1, "GET /v1/status 200": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("weightd_api_requests_total = %v, want %v", got, want)
	}
}

func TestStatusListsPeers(t *testing.T) {
	t.Parallel()
	peers := []Peer{{Name: "node-b", ChunkAddr: "10.0.0.2:7947", Zone: "z1"}}
	srv, err := NewServer(newFakeJobs(), fakeUsage{}, WithPeers(func() []Peer { return peers }))
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	c, err := NewClient(ts.URL)
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(st.Peers, peers) {
		t.Fatalf("peers %+v, want %+v", st.Peers, peers)
	}
}
