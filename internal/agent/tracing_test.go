package agent

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// otlpReceiver is an OTLP/HTTP trace receiver: it decodes every export
// request it gets.
type otlpReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	paths []string
	reqs  []*coltracepb.ExportTraceServiceRequest
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	r := &otlpReceiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		if !assert.NoError(t, err) {
			return
		}
		var msg coltracepb.ExportTraceServiceRequest
		if !assert.NoError(t, proto.Unmarshal(body, &msg), "content type %s", req.Header.Get("Content-Type")) {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		r.paths = append(r.paths, req.URL.Path)
		r.reqs = append(r.reqs, &msg)
		r.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(r.Close)
	return r
}

// spans returns the names of the spans received and the resource attributes
// of the first batch.
func (r *otlpReceiver) spans() (names []string, resource map[string]string, paths []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	resource = map[string]string{}
	for _, req := range r.reqs {
		for _, rs := range req.GetResourceSpans() {
			for _, kv := range rs.GetResource().GetAttributes() {
				resource[kv.GetKey()] = kv.GetValue().GetStringValue()
			}
			for _, ss := range rs.GetScopeSpans() {
				for _, s := range ss.GetSpans() {
					names = append(names, s.GetName())
				}
			}
		}
	}
	return names, resource, r.paths
}

// fetchTraced fetches a generated model through a queue traced by tp.
func fetchTraced(t *testing.T, tp trace.TracerProvider) {
	t.Helper()
	dir := t.TempDir()
	_, err := genmodel.Generate(dir, genmodel.Spec{Name: "org/model", Files: 2, TotalBytes: 64 << 10})
	require.NoError(t, err)
	org := httptest.NewServer(genmodel.NewServer(nil, dir))
	t.Cleanup(org.Close)
	store, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	q := prefetch.NewQueue(store, httpsource.New(nil), prefetch.WithTracerProvider(tp))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	j, err := q.Submit(org.URL+"/model.json", prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := j.Wait(t.Context())
	require.NoError(t, err)
	require.Equal(t, prefetch.StateReady, st.State)
}

func TestTracingExportsSpans(t *testing.T) {
	for _, how := range []string{"flag", "env"} {
		t.Run(how, func(t *testing.T) {
			recv := newOTLPReceiver(t)
			cfg := TracingConfig{OtelSampleRatio: 1}
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
			if how == "flag" {
				cfg.OtelEndpoint = recv.URL // no path: /v1/traces is added
				t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
			} else {
				t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", recv.URL)
			}
			tp, shutdown, err := NewTracerProvider(t.Context(), cfg, "node-a", "dev")
			require.NoError(t, err)
			fetchTraced(t, tp)
			require.NoError(t, shutdown(context.Background()), "flushes the batch")

			names, res, paths := recv.spans()
			assert.Contains(t, names, "prefetch")
			assert.Contains(t, names, "resolve")
			assert.Contains(t, names, "fetch")
			assert.Contains(t, names, "commit")
			assert.Equal(t, "weightd", res["service.name"])
			assert.Equal(t, "node-a", res["k8s.node.name"])
			for _, p := range paths {
				assert.Equal(t, "/v1/traces", p)
			}
		})
	}
}

func TestTracingOffByDefault(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	recv := newOTLPReceiver(t)
	tp, shutdown, err := NewTracerProvider(t.Context(), TracingConfig{OtelSampleRatio: 1}, "node-a", "dev")
	require.NoError(t, err)
	assert.IsType(t, noop.TracerProvider{}, tp)
	fetchTraced(t, tp)
	require.NoError(t, shutdown(context.Background()))
	names, _, _ := recv.spans()
	assert.Empty(t, names)
}

func TestTracingConfigErrors(t *testing.T) {
	for _, cfg := range []TracingConfig{
		{OtelEndpoint: "collector:4318", OtelSampleRatio: 1},
		{OtelEndpoint: "ftp://collector:4318", OtelSampleRatio: 1},
		{OtelEndpoint: "http://collector:4318", OtelSampleRatio: 1.5},
		{OtelSampleRatio: -0.1},
	} {
		_, shutdown, err := NewTracerProvider(t.Context(), cfg, "", "dev")
		assert.Error(t, err, "%+v", cfg)
		assert.NotNil(t, shutdown)
	}
}
