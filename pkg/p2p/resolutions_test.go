package p2p

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/content"
)

func TestResolveFromPeers(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 3, nil)
	m := content.Model{Name: "org/m", Revision: "main", Files: []content.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	nodes[2].res.Put("https://origin/m.json", m)
	any := func(content.Model) error { return nil }
	got, err := nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", any)
	require.NoError(t, err)
	require.Equal(t, m, got)

	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/other.json", any)
	require.ErrorContains(t, err, "404")
	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", func(content.Model) error { return errors.New("wrong digest") })
	require.ErrorContains(t, err, "wrong digest")

	// The memory is bounded: the oldest resolution goes first.
	nodes[2].res.Put("b", m)
	nodes[2].res.Put("c", m)
	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", any)
	require.Error(t, err)
}

func TestSharedResolveAsksTheOriginOnce(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	m := content.Model{Name: "org/m", Revision: strings.Repeat("ab", 20), Files: []content.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	const ref = "hf://org/m@abababababababababababababababababababab"
	var originCalls atomic.Int32
	g, ctx := errgroup.WithContext(t.Context())
	for _, n := range nodes {
		g.Go(func() error {
			got, err := n.swarm.SharedResolve(ctx, ref, func(context.Context) (content.Model, error) {
				originCalls.Add(1)
				time.Sleep(300 * time.Millisecond) // the origin is slow: the others must wait, not ask too
				n.res.Put(ref, m)
				return m, nil
			}, func(got content.Model) error {
				if got.Revision != m.Revision {
					return errors.New("wrong revision")
				}
				return nil
			})
			if err == nil && !reflect.DeepEqual(got, m) {
				err = fmt.Errorf("resolved %+v", got)
			}
			return err
		})
	}
	require.NoError(t, g.Wait())
	require.Equal(t, int32(1), originCalls.Load(), "one node asked the origin for the cluster")
}

func TestSharedResolveFallsBackToTheOrigin(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, nil)
	m := content.Model{Name: "org/m", Revision: "main", Files: []content.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	// Find a reference the other node is chosen for, and make its answer
	// unusable: the asking node goes to the origin itself.
	var ref string
	for i := 0; ; i++ {
		ref = fmt.Sprint("hf://org/m@", i)
		if _, other := nodes[0].swarm.resolver(resolutionKey(ref)); other {
			break
		}
	}
	nodes[1].res.Put(ref, m)
	var called bool
	got, err := nodes[0].swarm.SharedResolve(t.Context(), ref, func(context.Context) (content.Model, error) {
		called = true
		return m, nil
	}, func(content.Model) error { return errors.New("not the model asked for") })
	require.NoError(t, err)
	require.True(t, called)
	require.Equal(t, m, got)
}
