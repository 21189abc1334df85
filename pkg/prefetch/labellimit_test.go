package prefetch_test

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
)

func TestLabelLimiter(t *testing.T) {
	t.Parallel()
	l := prefetch.NewLabelLimiter(2)
	assert.Equal(t, "a", l.Label("a"))
	assert.Equal(t, "b", l.Label("b"))
	assert.Equal(t, "other", l.Label("c"))
	assert.Equal(t, "a", l.Label("a"), "a value seen keeps its name")
	assert.Equal(t, "other", l.Label(""))
	assert.Equal(t, "other", prefetch.NewLabelLimiter(-1).Label("a"))

	// Concurrent callers agree on which values are named.
	l = prefetch.NewLabelLimiter(10)
	var wg sync.WaitGroup
	var mu sync.Mutex
	named := map[string]bool{}
	for g := range 4 {
		wg.Go(func() {
			for i := range 100 {
				v := fmt.Sprint((i + g*25) % 100)
				if got := l.Label(v); got != prefetch.OtherLabel {
					mu.Lock()
					named[got] = true
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	assert.Len(t, named, 10)
}

// scrape is the text exposition of reg.
func scrape(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		require.NoError(t, enc.Encode(mf))
	}
	return buf.String()
}

// 10,000 distinct models become ready: the per-model metric keeps the first
// few names and counts the rest as "other", so its series and the scrape
// stay as they were once the limit was reached.
func TestQueueReadySecondsBounded(t *testing.T) {
	t.Parallel()
	const models, limit = 10000, 20
	src := &fakeSource{models: make(map[string]content.Model, models)}
	for i := range models {
		name := fmt.Sprintf("m%05d", i)
		src.models[name] = model(name, 1)
	}
	reg := prometheus.NewRegistry()
	q := prefetch.NewQueue(&fakeStore{}, src, prefetch.WithRegisterer(reg), prefetch.WithHistory(0),
		prefetch.WithModelLabels(limit), prefetch.WithJobConcurrency(4))
	sourcetest.RunQueue(t, q)
	run := func(from, to int) {
		t.Helper()
		jobs := make([]*prefetch.Job, 0, to-from)
		for i := from; i < to; i++ {
			j, err := q.Submit(refFor(fmt.Sprintf("m%05d", i)), prefetch.PriorityNormal)
			require.NoError(t, err)
			jobs = append(jobs, j)
		}
		for _, j := range jobs {
			_, err := sourcetest.Wait(t, j)
			require.NoError(t, err)
		}
	}
	run(0, 2*limit)
	before := scrape(t, reg)
	assert.Equal(t, limit+1, testutil.CollectAndCount(reg, "weightd_prefetch_ready_seconds"))

	for from := 2 * limit; from < models; from += 250 { // a queue of bounded length
		run(from, min(from+250, models))
	}
	after := scrape(t, reg)
	assert.Equal(t, limit+1, testutil.CollectAndCount(reg, "weightd_prefetch_ready_seconds"))
	assert.Equal(t, strings.Count(before, "\n"), strings.Count(after, "\n"), "no new lines in the scrape")
	// Only the numbers grew: at most a few more digits per line.
	assert.Less(t, len(after), len(before)+6*strings.Count(before, "\n"))
	assert.True(t, strings.Contains(after, fmt.Sprintf(`weightd_prefetch_ready_seconds_count{model="other"} %d`, models-limit)),
		"every model beyond the first %d is other", limit)
	assert.False(t, strings.Contains(after, "m09999"), "a late model is not named")
}
