package testbed

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"
)

// Listen makes a listener inside the host's network namespace, so that a
// server in the test's own process plays a machine of the testbed.
func (h *Host) Listen(network, addr string) (net.Listener, error) {
	return ListenIn(h.NS, network, addr)
}

// ListenIn makes a listener inside the network namespace that `ip netns`
// knows as name. A socket belongs to the namespace of the thread that
// created it, so the thread enters the namespace, listens and comes back;
// the listener keeps working from any thread afterwards.
func ListenIn(name, network, addr string) (net.Listener, error) {
	target, err := os.Open(filepath.Join("/run/netns", name))
	if err != nil {
		return nil, fmt.Errorf("opening network namespace %s: %w", name, err)
	}
	defer target.Close()

	type result struct {
		l   net.Listener
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer self.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("entering network namespace %s: %w", name, err)}
			return
		}
		l, lerr := net.Listen(network, addr)
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			// The thread stays locked and dies with this goroutine,
			// rather than run other goroutines in the wrong namespace.
			if l != nil {
				l.Close()
			}
			ch <- result{err: fmt.Errorf("leaving network namespace %s: %w", name, err)}
			return
		}
		runtime.UnlockOSThread()
		ch <- result{l: l, err: lerr}
	}()
	r := <-ch
	return r.l, r.err
}
