package main

import (
	"context"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/internal/benchnet"
)

// killer kills a node's agent (SIGKILL) once the node's containerd holds at
// bytes of the image.
type killer struct {
	node  *node
	agent *benchnet.Agent
	at    int64
}

// pullAll has the nodes of index which pull the image at the same moment,
// and returns each one's time at its index (zero for the others). With k,
// it kills k's agent on the way (an error if its node finishes first). The
// first failure cancels the other pulls and is returned.
func (b *bench) pullAll(ctx context.Context, nodes []*node, which []int, k *killer) ([]time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	took := make([]time.Duration, len(nodes))
	var (
		wg     sync.WaitGroup
		killed atomic.Bool
		done   = make(chan struct{}) // closed once every pull has ended
		start  = make(chan struct{})
	)
	if k != nil {
		go func() {
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-done:
					return
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				if held := k.node.contentBytes(); held >= k.at {
					log.Printf("killing the agent in %s (SIGKILL): its containerd holds %d of %d bytes", k.node.host.Name, held, b.size)
					killed.Store(true)
					if err := k.agent.Kill(); err != nil {
						cancel(fmt.Errorf("killing the agent in %s: %w", k.node.host.Name, err))
					}
					return
				}
			}
		}()
	}
	for _, i := range which {
		wg.Go(func() {
			<-start
			d, err := nodes[i].pull(ctx, b.client, b.img.Ref)
			switch {
			case err != nil:
				cancel(err)
			case k != nil && nodes[i] == k.node && !killed.Load():
				cancel(fmt.Errorf("%s finished its pull before it held half the image: nothing to kill", nodes[i].host.Name))
			default:
				took[i] = d
			}
		})
	}
	close(start)
	wg.Wait()
	close(done)
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	return took, nil
}

// fetchAll asks the agents of index which for the image through their
// API at the same moment (the swarm alone, containerd left out) and
// returns each one's time at its index (zero for the others). The first
// failure cancels the others and is returned.
func (b *bench) fetchAll(ctx context.Context, agents *benchnet.Agents, which []int) ([]time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	took := make([]time.Duration, len(agents.List))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for _, i := range which {
		a := agents.List[i]
		wg.Go(func() {
			<-start
			d, err := a.Fetch(ctx, "oci://"+b.img.Ref, nil)
			if err != nil {
				cancel(err)
				return
			}
			took[i] = d
		})
	}
	close(start)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	return took, nil
}
