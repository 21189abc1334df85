package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
)

// TestStatusMinFree: status reports the cache's free-space floor beside the
// disk's free space, and nothing where there is none.
func TestStatusMinFree(t *testing.T) {
	t.Parallel()
	render := func(u cache.Usage) string {
		var buf bytes.Buffer
		renderStatus(&buf, api.Status{Version: "v1", Cache: u}, statusView{api: "http://agent", now: statusNow})
		return buf.String()
	}
	out := render(cache.Usage{DiskFree: 200 << 30, MinFree: 40 << 30})
	assert.Contains(t, out, "disk free  200.0 GiB, keeps 40.0 GiB free\n")
	out = render(cache.Usage{DiskFree: 200 << 30})
	assert.Contains(t, out, "disk free  200.0 GiB\n")
}
