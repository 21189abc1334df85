package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// weightdBinary builds the weightd binary once per test run.
func weightdBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "weightd-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "weightd")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			buildErr = errors.New(string(out))
		}
	})
	if buildErr != nil {
		t.Fatalf("building weightd: %v", buildErr)
	}
	return binPath
}

// TestMain removes the binary built for the tests.
func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

// syncBuffer is a bytes.Buffer safe to read while a child process writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startAgentProcess starts `weightd agent` as a child process and waits until
// its API answers ready.
func startAgentProcess(t *testing.T) (*exec.Cmd, string, *syncBuffer) {
	t.Helper()
	bin := weightdBinary(t)
	dir := testdisk.ShortDir(t)
	sock := filepath.Join(dir, "run", "weightd.sock")
	addr := "unix://" + sock
	cmd := exec.Command(bin, "agent", "--root", filepath.Join(dir, "cache"), "--api", addr,
		"--metrics-addr", "127.0.0.1:0", "--shutdown-timeout", "30s",
		"--gossip-addr", "127.0.0.1:0", "--chunk-addr", "127.0.0.1:0", "--peer-insecure")
	var logs syncBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	client, err := api.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := client.WaitReady(ctx); err != nil {
		t.Fatalf("%v; agent output:\n%s", err, logs.String())
	}
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != api.SocketMode {
		t.Fatalf("socket: %v, %v", fi, err)
	}
	return cmd, sock, &logs
}

// waitExit waits up to timeout for cmd to exit and returns its exit code.
func waitExit(t *testing.T, cmd *exec.Cmd, timeout time.Duration, logs *syncBuffer) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) {
			t.Fatalf("waiting for the agent: %v", err)
		}
		return cmd.ProcessState.ExitCode()
	case <-time.After(timeout):
		t.Fatalf("the agent did not exit within %v; output:\n%s", timeout, logs.String())
		return -1
	}
}

func TestAgentProcessStopsCleanlyOnSIGTERM(t *testing.T) {
	t.Parallel()
	cmd, sock, logs := startAgentProcess(t)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 15*time.Second, logs); code != 0 {
		t.Fatalf("exit code %d, want 0; output:\n%s", code, logs.String())
	}
	if !strings.Contains(logs.String(), "weightd agent stopped") {
		t.Errorf("no clean stop in the logs:\n%s", logs.String())
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

func TestAgentProcessSecondSignalExitsAtOnce(t *testing.T) {
	t.Parallel()
	cmd, sock, logs := startAgentProcess(t)
	// A client that has sent half a request keeps the graceful shutdown
	// waiting (for up to --shutdown-timeout, or 5 s for a new connection).
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("GET /v1/status HTTP/1.1\r\nHost: weightd\r\n")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // let the server read it

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	for !strings.Contains(logs.String(), "shutting down gracefully") {
		if ctx.Err() != nil {
			t.Fatalf("the agent did not start shutting down; output:\n%s", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, cmd, 3*time.Second, logs); code != 130 {
		t.Fatalf("exit code %d, want 130; output:\n%s", code, logs.String())
	}
	t.Logf("exited %v after the second signal", time.Since(start).Round(time.Millisecond))
}
