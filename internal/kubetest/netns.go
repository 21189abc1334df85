package kubetest

import (
	"io"
	"net"
	"sync"

	"github.com/weightd/weightd/internal/testbed"
)

// forwarder accepts TCP connections on a listener made inside a network
// namespace and joins each to a connection to the API server. The TLS
// stream passes through untouched.
type forwarder struct {
	l      net.Listener
	target string

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// listenForward listens on addr inside the named network namespace and
// forwards every connection to target (an address in this process's own
// namespace).
func listenForward(netns, addr, target string) (*forwarder, error) {
	l, err := testbed.ListenIn(netns, "tcp", addr)
	if err != nil {
		return nil, err
	}
	f := &forwarder{l: l, target: target, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.serve()
	return f, nil
}

func (f *forwarder) serve() {
	defer f.wg.Done()
	for {
		c, err := f.l.Accept()
		if err != nil {
			return
		}
		f.wg.Add(1)
		go f.join(c)
	}
}

func (f *forwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		c.Close()
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *forwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (f *forwarder) join(c net.Conn) {
	defer f.wg.Done()
	if !f.track(c) {
		return
	}
	defer f.untrack(c)
	// While the API server is stopped the dial fails and the client sees
	// its connection closed, as it would see a refused one.
	up, err := net.Dial("tcp", f.target)
	if err != nil {
		return
	}
	if !f.track(up) {
		return
	}
	defer f.untrack(up)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src) // either side closing ends the copy
		// Half-close so that the other direction drains, then ends.
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done
	<-done
}

func (f *forwarder) close() {
	f.l.Close()
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}
