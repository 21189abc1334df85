package p2p_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/p2p"
)

// Two agents in one process: b joins a, announces a blob, and a's router
// learns that b holds it.
func ExampleMembership() {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	start := func(name string, join ...string) (*p2p.Membership, *p2p.Router) {
		router := p2p.NewRouter(10 * time.Minute)
		m, err := p2p.NewMembership(p2p.MembershipConfig{
			NodeName: name,
			BindAddr: "127.0.0.1", // BindPort 0: any free port
			Join:     join,
			Meta:     p2p.NodeMeta{ChunkAddr: "127.0.0.1:7947", Zone: "zone-a"},
			Fast:     true,
		}, router)
		if err != nil {
			panic(err)
		}
		wg.Go(func() {
			if err := m.Run(ctx); err != nil {
				panic(err)
			}
		})
		<-m.Ready()
		return m, router
	}
	a, routerA := start("node-a")
	b, _ := start("node-b", a.LocalAddr())

	blob := digest.FromString("model weights")
	if err := b.Announce(p2p.EventComplete, blob); err != nil {
		panic(err)
	}
	for deadline := time.Now().Add(10 * time.Second); len(routerA.Holders(blob)) == 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	for _, h := range routerA.Holders(blob) {
		peer, _ := a.Peer(h.Peer)
		fmt.Println(h.Peer, "complete:", h.Complete, "chunks at", peer.Meta.ChunkAddr)
	}
	// Output:
	// node-b complete: true chunks at 127.0.0.1:7947
}
