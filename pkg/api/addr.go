package api

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// ErrInvalidAddr is returned for an API address that is neither
// "unix:///absolute/path" nor "tcp://host:port" (or "http://host:port").
var ErrInvalidAddr = errors.New("invalid API address")

// SocketMode is the permission of the agent's unix socket: the owner and its
// group may connect.
const SocketMode = 0o660

// ParseAddr splits an API address into a network ("unix" or "tcp") and an
// address for net.Dial and net.Listen. It accepts "unix:///path/to.sock" (an
// absolute path) and "tcp://host:port" or "http://host:port".
func ParseAddr(addr string) (network, address string, err error) {
	u, err := url.Parse(addr)
	if err != nil {
		return "", "", fmt.Errorf("%w %q: %v", ErrInvalidAddr, addr, err)
	}
	switch u.Scheme {
	case "unix":
		p := u.Path
		if u.Host != "" || u.Opaque != "" || !filepath.IsAbs(p) || u.RawQuery != "" || u.Fragment != "" {
			return "", "", fmt.Errorf("%w %q: want unix:///absolute/path.sock", ErrInvalidAddr, addr)
		}
		return "unix", filepath.Clean(p), nil
	case "tcp", "http":
		if u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
			return "", "", fmt.Errorf("%w %q: want %s://host:port", ErrInvalidAddr, addr, u.Scheme)
		}
		if _, _, err := net.SplitHostPort(u.Host); err != nil {
			return "", "", fmt.Errorf("%w %q: %v", ErrInvalidAddr, addr, err)
		}
		return "tcp", u.Host, nil
	default:
		return "", "", fmt.Errorf("%w %q: scheme must be unix, tcp or http", ErrInvalidAddr, addr)
	}
}

// Listen opens the listener for an API address (see ParseAddr). For a unix
// socket it creates the parent directory, removes a stale socket left by an
// earlier run (but refuses to replace a socket some process still answers on,
// or a file that is not a socket) and sets the socket's mode to SocketMode.
func Listen(addr string) (net.Listener, error) {
	network, address, err := ParseAddr(addr)
	if err != nil {
		return nil, err
	}
	if network == "tcp" {
		return net.Listen(network, address)
	}
	if err := os.MkdirAll(filepath.Dir(address), 0o755); err != nil {
		return nil, fmt.Errorf("creating socket directory: %w", err)
	}
	if err := removeStaleSocket(address); err != nil {
		return nil, err
	}
	ln, err := net.Listen("unix", address)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(address, SocketMode); err != nil {
		ln.Close()
		return nil, fmt.Errorf("setting socket mode: %w", err)
	}
	return ln, nil
}

func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("socket %s is in use by another process", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing stale socket: %w", err)
	}
	return nil
}
