package adversary

// Attack 11, one tenant holding every job slot: pods of one namespace ask
// the node for many slow downloads before another namespace's pod asks for
// one. The queue is the agent's (prefetch.Queue with its default job
// slots), fetching from a real HTTP origin that holds each download until
// the test lets it finish.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// TestQueueFairnessAcrossNamespaces: namespace team-a queues 50 slow jobs,
// then team-b queues one. Once one of team-a's running jobs ends, team-b's
// job must start: it may not wait for team-a's other 49.
func TestQueueFairnessAcrossNamespaces(t *testing.T) {
	const slow = 50
	release := make(chan struct{})
	started := make(chan string, slow+1)
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := strings.Repeat(r.URL.Path, 8)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if r.Method == http.MethodHead {
			return
		}
		started <- r.URL.Path
		if strings.HasPrefix(r.URL.Path, "/team-a/") {
			select { // team-a's downloads are slow: each ends when the test says
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		w.Write([]byte(body))
	}))
	t.Cleanup(origin.Close)
	ref := func(path string) string {
		return origin.URL + path + "#" + digest.FromString(strings.Repeat(path, 8)).String()
	}

	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(1<<20), cache.WithBudget(0, 0))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	q := prefetch.NewQueue(store, httpsource.New(nil), prefetch.WithResolveRetries(1, 0))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})

	var a []*prefetch.Job
	for i := range slow {
		j, err := q.Submit(ref(fmt.Sprintf("/team-a/%02d.bin", i)), prefetch.PriorityPod, prefetch.ForNamespace("team-a"))
		require.NoError(t, err)
		a = append(a, j)
	}
	for range prefetch.DefaultJobConcurrency {
		<-started // every slot holds one of team-a's downloads
	}
	b, err := q.Submit(ref("/team-b/model.bin"), prefetch.PriorityPod, prefetch.ForNamespace("team-b"))
	require.NoError(t, err)

	release <- struct{}{} // one of team-a's jobs ends
	wait, stop := context.WithTimeout(t.Context(), 30*time.Second)
	defer stop()
	for {
		select {
		case path := <-started:
			if path == "/team-b/model.bin" {
				st, err := b.Wait(wait)
				require.NoError(t, err)
				require.Equal(t, prefetch.StateReady, st.State)
				ready := 0
				for _, j := range a {
					if j.Status().State == prefetch.StateReady {
						ready++
					}
				}
				t.Logf("team-b's job started after %d of team-a's %d jobs ended", ready, slow)
				return
			}
		case <-wait.Done():
			ready := 0
			for _, j := range a {
				if j.Status().State == prefetch.StateReady {
					ready++
				}
			}
			t.Fatalf("team-b's job is still %s after %d of team-a's %d jobs ended: team-a holds every job slot", b.Status().State, ready, slow)
		}
	}
}
