package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// helperEnv, when set, makes the test binary run one of the helper programs
// below instead of the tests: that is how a test runs a program in a host.
const helperEnv = "WDT_TESTBED_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		if err := runHelper(os.Args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperLife bounds every helper program, whatever its peer does.
const helperLife = 60 * time.Second

// runHelper runs a helper program:
//
//	echo ADDR           serve: echo each line back, on up to 16 connections
//	send ADDR MSG       dial (1 s timeout), send MSG, print the line echoed
//	sink ADDR           serve one connection: read to EOF, print "BYTES SECONDS"
//	                    (from the first byte to EOF)
//	source ADDR BYTES   dial, send BYTES bytes, close
//
// Servers print "ready" once they listen.
func runHelper(args []string) error {
	if len(args) < 2 {
		return fmt.Errorf("usage: echo|send|sink|source ADDR [ARG], not %q", args)
	}
	deadline := time.Now().Add(helperLife)
	switch cmd, addr := args[0], args[1]; cmd {
	case "echo", "sink":
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		if err := ln.(*net.TCPListener).SetDeadline(deadline); err != nil {
			return err
		}
		fmt.Println("ready")
		if cmd == "sink" {
			return sink(ln, deadline)
		}
		for range 16 {
			c, err := ln.Accept()
			if err != nil {
				return err
			}
			go func() {
				defer c.Close()
				if c.SetDeadline(deadline) == nil {
					_, _ = io.Copy(c, c) // the client sees what came back
				}
			}()
		}
		return nil
	case "send":
		if len(args) != 3 {
			return errors.New("usage: send ADDR MSG")
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		if err := c.SetDeadline(time.Now().Add(time.Second)); err != nil {
			return err
		}
		if _, err := fmt.Fprintln(c, args[2]); err != nil {
			return err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			return err
		}
		fmt.Print(line)
		return nil
	case "source":
		if len(args) != 3 {
			return errors.New("usage: source ADDR BYTES")
		}
		n, err := strconv.ParseInt(args[2], 10, 64)
		if err != nil {
			return err
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		if err := c.SetDeadline(deadline); err != nil {
			return err
		}
		buf := make([]byte, 64<<10)
		for i := range buf {
			buf[i] = byte(i * 7)
		}
		for n > 0 {
			w, err := c.Write(buf[:min(n, int64(len(buf)))])
			if err != nil {
				return err
			}
			n -= int64(w)
		}
		return nil
	default:
		return fmt.Errorf("unknown helper %q", cmd)
	}
}

// sink serves one connection of ln: it reads to EOF and prints the bytes
// received and the seconds from the first byte to EOF.
func sink(ln net.Listener, deadline time.Time) error {
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(deadline); err != nil {
		return err
	}
	buf := make([]byte, 256<<10)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	start := time.Now()
	rest, err := io.CopyBuffer(io.Discard, c, buf)
	if err != nil {
		return err
	}
	fmt.Println(int64(n)+rest, time.Since(start).Seconds())
	return nil
}

// helper returns a command that runs a helper program in h.
func helper(t *testing.T, ctx context.Context, h *Host, args ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := h.Command(ctx, exe, args...)
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.Stderr = os.Stderr
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// serve starts a helper server in h and waits (5 s at most) until it
// listens. It returns the server's stdout after the "ready" line; the server
// is killed when the test ends.
func serve(t *testing.T, h *Host, args ...string) *bufio.Reader {
	t.Helper()
	cmd := helper(t, t.Context(), h, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Wait() }) // t.Context() is done by then: the server is killed
	r := bufio.NewReader(stdout)
	ready := make(chan error, 1)
	go func() {
		line, err := r.ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("server said %q, want ready", line)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatalf("starting %q in %s: %v", args, h.Name, err)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("starting %q in %s: not ready after 5s", args, h.Name)
	}
	return r
}

// send runs the send helper in from against addr and returns what came back.
func send(t *testing.T, from *Host, addr, msg string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	cmd := helper(t, ctx, from, "send", addr, msg)
	cmd.Stderr = nil
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
		}
		return "", err
	}
	return strings.TrimSpace(string(out)), nil
}
