package prefetch_test

import (
	"context"
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
)

// recordSpans returns a tracer provider whose ended spans sr records.
func recordSpans(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { assert.NoError(t, tp.Shutdown(context.Background())) })
	return tp, sr
}

// spansByName groups ended spans by name.
func spansByName(sr *tracetest.SpanRecorder) map[string][]sdktrace.ReadOnlySpan {
	out := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range sr.Ended() {
		out[s.Name()] = append(out[s.Name()], s)
	}
	return out
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	out := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		out[kv.Key] = kv.Value
	}
	return out
}

func TestQueueTracesJob(t *testing.T) {
	t.Parallel()
	tp, sr := recordSpans(t)
	m := model("m", 10, 20, 10)
	q := prefetch.NewQueue(&fakeStore{}, &fakeSource{models: map[string]content.Model{"m": m}}, prefetch.WithTracerProvider(tp))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityPod)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err)

	spans := spansByName(sr)
	require.Len(t, spans["prefetch"], 1, "the job's span ends before the job is seen done")
	root := spans["prefetch"][0]
	assert.False(t, root.Parent().IsValid())
	assert.Equal(t, codes.Unset, root.Status().Code)
	a := attrs(root)
	assert.Equal(t, "http", a[prefetch.AttrRefKind].AsString())
	assert.Equal(t, "pod", a[prefetch.AttrPriority].AsString())
	assert.Equal(t, j.ID(), a[prefetch.AttrJob].AsString())
	assert.Equal(t, int64(30), a[prefetch.AttrBytes].AsInt64())
	assert.Equal(t, "ready", a[prefetch.AttrOutcome].AsString())
	assert.Equal(t, "org/m@main", a[prefetch.AttrModel].AsString())

	require.Len(t, spans["resolve"], 1)
	require.Len(t, spans["fetch"], 2, "one per distinct blob")
	require.Len(t, spans["commit"], 1)
	assert.Empty(t, spans["import"])
	for _, name := range []string{"resolve", "fetch", "commit"} {
		for _, s := range spans[name] {
			assert.Equal(t, root.SpanContext().SpanID(), s.Parent().SpanID(), "%s is a child of prefetch", name)
			assert.Equal(t, root.SpanContext().TraceID(), s.SpanContext().TraceID())
		}
	}
	var fetched []string
	for _, s := range spans["fetch"] {
		a := attrs(s)
		fetched = append(fetched, a[prefetch.AttrBlobDigest].AsString())
		size := map[string]int64{m.Files[0].Digest.String(): 10, m.Files[1].Digest.String(): 20}[a[prefetch.AttrBlobDigest].AsString()]
		assert.Equal(t, size, a[prefetch.AttrBlobSize].AsInt64())
	}
	assert.ElementsMatch(t, []string{m.Files[0].Digest.String(), m.Files[1].Digest.String()}, fetched)
}

func TestQueueTracesFailures(t *testing.T) {
	t.Parallel()
	tp, sr := recordSpans(t)
	m := model("m", 10, 20)
	broken := errors.New("origin on fire")
	store := &fakeStore{fail: map[digest.Digest]error{m.Files[1].Digest: content.Permanent(broken)}}
	q := prefetch.NewQueue(store, &fakeSource{models: map[string]content.Model{"m": m}}, prefetch.WithTracerProvider(tp))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.ErrorIs(t, err, broken)

	spans := spansByName(sr)
	require.Len(t, spans["prefetch"], 1)
	root := spans["prefetch"][0]
	assert.Equal(t, codes.Error, root.Status().Code)
	assert.Contains(t, root.Status().Description, "origin on fire")
	assert.Equal(t, "failed", attrs(root)[prefetch.AttrOutcome].AsString())
	require.Len(t, spans["fetch"], 2)
	for _, f := range spans["fetch"] {
		if attrs(f)[prefetch.AttrBlobDigest].AsString() != m.Files[1].Digest.String() {
			continue
		}
		assert.Equal(t, codes.Error, f.Status().Code)
		require.NotEmpty(t, f.Events())
		assert.Equal(t, "exception", f.Events()[0].Name, "the error is recorded")
	}
	assert.Empty(t, spans["commit"])

	// Resolving fails: the resolve span says so.
	j, err = q.Submit(refFor("nope"), prefetch.PriorityNormal)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.Error(t, err)
	spans = spansByName(sr)
	require.Len(t, spans["resolve"], 2)
	var failed int
	for _, s := range spans["resolve"] {
		if s.Status().Code == codes.Error {
			failed++
		}
	}
	assert.Equal(t, 1, failed)
}

func TestQueueTracesImport(t *testing.T) {
	t.Parallel()
	tp, sr := recordSpans(t)
	store := sourcetest.OpenStore(t)
	imp := &fakeImporter{store: store}
	q := prefetch.NewQueue(store, imageSource{imageResolution()}, prefetch.WithImporter(imp), prefetch.WithTracerProvider(tp))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err)
	spans := spansByName(sr)
	require.Len(t, spans["prefetch"], 1)
	assert.Equal(t, "oci", attrs(spans["prefetch"][0])[prefetch.AttrRefKind].AsString())
	require.Len(t, spans["import"], 1)
	assert.Equal(t, "registry.example/org/app:v1", attrs(spans["import"][0])[prefetch.AttrImage].AsString())
	assert.Equal(t, spans["prefetch"][0].SpanContext().SpanID(), spans["import"][0].Parent().SpanID())
	assert.Len(t, spans["fetch"], 4)
	assert.Empty(t, spans["commit"])
}

func TestQueueNotTracedByDefault(t *testing.T) {
	t.Parallel()
	q := prefetch.NewQueue(&fakeStore{}, &fakeSource{models: map[string]content.Model{"m": model("m", 10)}})
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err, "the no-op tracer changes nothing")
}
