package main

import (
	"context"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/pkg/prefetch"
)

// fetchAll asks agent i to fetch ref delays[i] after a common start, and
// returns how long each took from its own request. If victim is an agent's
// index, that agent is killed (SIGKILL) once it holds half bytes: its
// failure is then expected and its time left zero; it is an error if it
// finishes before. The first other failure cancels the rest and is returned.
func fetchAll(ctx context.Context, agents []*benchnet.Agent, ref string, delays []time.Duration, victim int, half int64) ([]time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	took := make([]time.Duration, len(agents))
	var (
		wg     sync.WaitGroup
		killed atomic.Bool
		start  = make(chan struct{})
	)
	for i, a := range agents {
		wg.Go(func() {
			<-start
			select {
			case <-time.After(delays[i]):
			case <-ctx.Done():
				return
			}
			var onStatus func(prefetch.JobStatus)
			if i == victim {
				onStatus = func(st prefetch.JobStatus) {
					if !st.State.Finished() && st.BytesDone >= half && killed.CompareAndSwap(false, true) {
						log.Printf("killing the agent in %s (SIGKILL) at %d of %d bytes", a.Node, st.BytesDone, st.BytesTotal)
						if err := a.Kill(); err != nil {
							cancel(fmt.Errorf("killing the agent in %s: %w", a.Node, err))
						}
					}
				}
			}
			d, err := a.Fetch(ctx, ref, onStatus)
			switch {
			case i == victim && killed.Load(): // it died, as planned
			case i == victim && err == nil:
				cancel(fmt.Errorf("%s finished before it held half the blob: nothing to kill", a.Node))
			case err != nil:
				cancel(err)
			default:
				took[i] = d
			}
		})
	}
	close(start)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	return took, nil
}
