package prefetch

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// TracerName is the instrumentation scope of the queue's spans.
const TracerName = "github.com/weightd/weightd/pkg/prefetch"

// Span attributes of the queue's spans.
const (
	AttrJob         = attribute.Key("weightd.job.id")
	AttrRef         = attribute.Key("weightd.ref") // redacted
	AttrRefKind     = attribute.Key("weightd.ref.kind")
	AttrPriority    = attribute.Key("weightd.priority")
	AttrModel       = attribute.Key("weightd.model") // org/name@revision
	AttrBytes       = attribute.Key("weightd.bytes")
	AttrFiles       = attribute.Key("weightd.files")
	AttrOutcome     = attribute.Key("weightd.outcome") // ready, failed or canceled
	AttrBlobDigest  = attribute.Key("weightd.blob.digest")
	AttrBlobSize    = attribute.Key("weightd.blob.size")
	AttrBlobPath    = attribute.Key("weightd.blob.path")
	AttrImage       = attribute.Key("weightd.image")
	AttrLayerDigest = attribute.Key("weightd.layer.digest")
)

// WithTracerProvider makes the queue trace its jobs with tp (default: a
// no-op provider, nothing is traced). Each job that runs is a "prefetch"
// span (attributes: job, redacted ref, ref kind, priority, then model,
// bytes, files and outcome) with children "resolve" (every attempt),
// one "fetch" per distinct blob (digest, size, first path), "unpack" per
// packed layer, then "commit" (materialising the model) or "import"
// (handing the image to the container runtime). A span that failed records
// its error and has status Error.
func WithTracerProvider(tp trace.TracerProvider) QueueOption {
	return func(c *queueConfig) {
		if tp != nil {
			c.tracer = tp.Tracer(TracerName)
		}
	}
}

// startJobSpan starts the "prefetch" span of a job taken by a worker.
func (q *Queue) startJobSpan(ctx context.Context, j *Job) (context.Context, trace.Span) {
	st := j.Status()
	return q.cfg.tracer.Start(ctx, "prefetch", trace.WithAttributes(
		AttrJob.String(j.id),
		AttrRef.String(st.Ref),
		AttrRefKind.String(string(j.ref.Kind)),
		AttrPriority.String(st.Priority.String()),
	))
}

// endJobSpan ends a job's span with what the job came to.
func endJobSpan(s trace.Span, st JobStatus, err error) {
	if st.Model != "" {
		s.SetAttributes(AttrModel.String(modelRef(st.Model, st.Revision)))
	}
	s.SetAttributes(AttrBytes.Int64(st.BytesTotal), AttrFiles.Int(st.FilesTotal), AttrOutcome.String(outcomeOf(err)))
	endSpan(s, err)
}

// endSpan records err, if any, on s and ends it.
func endSpan(s trace.Span, err error) {
	if err != nil {
		s.RecordError(err)
		s.SetStatus(codes.Error, err.Error())
	}
	s.End()
}

// modelRef is the name a model is materialised under: org/name@revision.
func modelRef(name, revision string) string {
	if revision == "" {
		return name
	}
	return name + "@" + revision
}
