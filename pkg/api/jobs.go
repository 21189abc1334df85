package api

import (
	"context"

	"github.com/weightd/weightd/pkg/prefetch"
)

// QueueJobs adapts a prefetch queue to the Jobs the server needs.
func QueueJobs(q *prefetch.Queue) Jobs { return queueJobs{q} }

type queueJobs struct{ q *prefetch.Queue }

func (a queueJobs) Submit(ref string, p prefetch.Priority) (prefetch.JobStatus, error) {
	j, err := a.q.Submit(ref, p)
	if err != nil {
		return prefetch.JobStatus{}, err
	}
	return j.Status(), nil
}

func (a queueJobs) Cancel(id string) (prefetch.JobStatus, bool) {
	if !a.q.Cancel(id) {
		return prefetch.JobStatus{}, false
	}
	return a.Status(id)
}

func (a queueJobs) Status(id string) (prefetch.JobStatus, bool) {
	j, ok := a.q.Job(id)
	if !ok {
		return prefetch.JobStatus{}, false
	}
	return j.Status(), true
}

func (a queueJobs) Watch(ctx context.Context, id string) (<-chan prefetch.JobStatus, bool) {
	j, ok := a.q.Job(id)
	if !ok {
		return nil, false
	}
	return j.Watch(ctx), true
}

func (a queueJobs) List() []prefetch.JobStatus { return a.q.Jobs() }
