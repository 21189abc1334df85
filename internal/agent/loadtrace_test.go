package agent

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

// TestAgentTracesModelLoads runs an agent with the load tracer on, fetches a
// model, reads its files with cat (a real process, outside any pod) in an
// order of the test's choosing, and waits for the agent's status to report
// the load with that first-read order.
func TestAgentTracesModelLoads(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true but loading BPF needs root")
		}
		t.Skip("loading BPF needs root")
	}
	url, _ := startOrigin(t, 3, 3<<20)
	addr := startAgentWith(t, func(c *Config) { c.LoadTrace = true })
	st := fetchWait(t, addr, url)
	if st.State != prefetch.StateReady {
		t.Fatalf("fetch: %s: %s", st.State, st.Error)
	}
	entries, err := os.ReadDir(st.Dir)
	if err != nil {
		t.Fatal(err)
	}
	var order, paths []string
	for _, e := range slices.Backward(entries) {
		order = append(order, e.Name())
		paths = append(paths, filepath.Join(st.Dir, e.Name()))
	}
	client, err := api.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	model := st.Model + "@" + st.Revision
	// The tracer attaches as the agent runs, maybe in the middle of a read:
	// read, let the load end (the tracer's quiet period is 2s), and again,
	// until a load of every file is seen.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if out, err := exec.Command("cat", paths...).CombinedOutput(); err != nil {
			t.Fatalf("cat: %v: %s", err, out)
		}
		time.Sleep(3 * time.Second)
		status, err := client.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(status.Loads, func(l api.ModelLoad) bool {
			return l.Model == model && l.Open == 0 && l.Files == len(paths)
		})
		if i >= 0 {
			if l := status.Loads[i]; l.Seconds <= 0 || !slices.Equal(l.Order, order) {
				t.Errorf("load of %s: %v s, files first read in the order %v, want %v", model, l.Seconds, l.Order, order)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ended load of all %d files of %s in the agent's status after 60s: %+v", len(paths), model, status.Loads)
		}
	}
}
