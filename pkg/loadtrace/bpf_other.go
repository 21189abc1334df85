//go:build !linux || !amd64

package loadtrace

import (
	"errors"
	"runtime"
)

// probe is the attached program; never made on this platform.
type probe struct {
	drops func() ([3]uint64, error)
}

func (p *probe) read(func(event)) error { return nil }
func (p *probe) stop()                  {}
func (p *probe) close()                 {}

// attach fails: the BPF program is built for Linux on amd64 only.
func attach(Config, []string) (*probe, error) {
	return nil, errors.New("the eBPF tracer is built for linux/amd64, not " + runtime.GOOS + "/" + runtime.GOARCH)
}
