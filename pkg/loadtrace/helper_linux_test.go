//go:build linux && amd64

package loadtrace

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// helperEnv names the mode in which the test binary runs as a child
// process; unset, it runs the tests.
const helperEnv = "LOADTRACE_TEST_HELPER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		if err := runHelper(mode, os.Args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runHelper is the child process's side of the tests.
//
//	load FILE...    open each file (a "rel:" prefix: relative to the working
//	                directory), read them last to first, sleep, close all;
//	                print the seconds from before the first open to after
//	                the last close
//	burst N FILE    open and close FILE N times, then print "done N"
//	unprivileged DIR   become nobody, run a tracer on DIR, print what it did
func runHelper(mode string, args []string) error {
	switch mode {
	case "load":
		start := time.Now()
		var files []*os.File
		for _, a := range args {
			f, err := os.Open(strings.TrimPrefix(a, "rel:"))
			if err != nil {
				return err
			}
			files = append(files, f)
		}
		buf := make([]byte, 1)
		for i := len(files) - 1; i >= 0; i-- {
			if _, err := files[i].Read(buf); err != nil {
				return err
			}
		}
		time.Sleep(100 * time.Millisecond)
		for _, f := range files {
			f.Close()
		}
		fmt.Println(time.Since(start).Seconds())
		return nil
	case "burst":
		n, err := strconv.Atoi(args[0])
		if err != nil {
			return err
		}
		for range n {
			fd, err := syscall.Open(args[1], syscall.O_RDONLY, 0)
			if err != nil {
				return err
			}
			syscall.Close(fd)
		}
		fmt.Println("done", n)
		return nil
	case "unprivileged":
		if err := syscall.Setresuid(65534, 65534, 65534); err != nil {
			return err
		}
		var logged logCounter
		reg := prometheus.NewRegistry()
		tr, err := New(Config{ModelsDirs: []string{args[0]}, Registerer: reg, Logger: slog.New(&logged)})
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		runErr := tr.Run(ctx)
		if ctx.Err() != nil {
			return errors.New("Run did not return")
		}
		out := unprivilegedResult{Available: testutil.ToFloat64(tr.m.available), Warnings: logged.warnings}
		if runErr != nil {
			out.Err = runErr.Error()
		}
		return json.NewEncoder(os.Stdout).Encode(out)
	}
	return fmt.Errorf("unknown mode %q", mode)
}

type unprivilegedResult struct {
	Err       string  `json:"err"`
	Available float64 `json:"available"`
	Warnings  int     `json:"warnings"`
}
