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

// pulls are the times of the nodes' pulls, at each node's index (zero for
// the nodes that did not pull).
type pulls struct {
	took []time.Duration // from the pull's start to its end
	// held runs to when the node's content store first held every byte
	// of the image: a CRI pull then still unpacks what it has not yet.
	held []time.Duration
}

// pullAll has the nodes of index which pull the image at the same moment,
// and returns their times. With k, it kills k's agent on the way (an error
// if its node finishes first). The first failure cancels the other pulls
// and is returned.
func (b *bench) pullAll(ctx context.Context, nodes []*node, which []int, k *killer) (pulls, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	p := pulls{took: make([]time.Duration, len(nodes)), held: make([]time.Duration, len(nodes))}
	var (
		wg     sync.WaitGroup
		killed atomic.Bool
		done   = make(chan struct{}) // closed once every pull has ended
		start  = make(chan struct{})
		t0     time.Time
	)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		<-start
		b.watchHeld(ctx, done, nodes, which, t0, p.held)
	}()
	if k != nil {
		go poll(ctx, done, func() bool {
			held := k.node.contentBytes()
			if held < k.at {
				return false
			}
			log.Printf("killing the agent in %s (SIGKILL): its containerd holds %d of %d bytes", k.node.host.Name, held, b.size)
			killed.Store(true)
			if err := k.agent.Kill(); err != nil {
				cancel(fmt.Errorf("killing the agent in %s: %w", k.node.host.Name, err))
			}
			return true
		})
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
				p.took[i] = d
			}
		})
	}
	t0 = time.Now()
	close(start)
	wg.Wait()
	close(done)
	<-sampled
	if err := context.Cause(ctx); err != nil {
		return pulls{}, err
	}
	for _, i := range which {
		if p.held[i] == 0 || p.held[i] > p.took[i] {
			p.held[i] = p.took[i] // whole between two looks, or committed at the end
		}
	}
	return p, nil
}

// watchHeld looks, every 100 ms until done, at the content stores of the
// nodes of index which, and notes in held when each first holds the
// image's bytes, counted from t0.
func (b *bench) watchHeld(ctx context.Context, done <-chan struct{}, nodes []*node, which []int, t0 time.Time, held []time.Duration) {
	poll(ctx, done, func() bool {
		for _, i := range which {
			if held[i] == 0 && nodes[i].contentBytes() >= b.size {
				held[i] = time.Since(t0)
			}
		}
		return false
	})
}

// poll calls look every 100 ms until it returns true, done is closed or
// ctx ends.
func poll(ctx context.Context, done <-chan struct{}, look func() bool) {
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
		if look() {
			return
		}
	}
}

// fetchAll asks the agents of index which for the image through their
// API at the same moment (the swarm alone, containerd left out) and
// returns their times (no held: no content store takes part). The first
// failure cancels the others and is returned.
func (b *bench) fetchAll(ctx context.Context, agents *benchnet.Agents, which []int) (pulls, error) {
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
		return pulls{}, err
	}
	return pulls{took: took}, nil
}
