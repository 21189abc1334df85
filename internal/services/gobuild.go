package services

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
)

// toolCacheDir returns the directory a tool built from the Go module proxy
// is kept in: $<env>/<name>, or $HOME/.cache/weightd/<name> when that
// variable is empty. name carries the version ("containerd-2.4.2"), so a new
// release builds beside the old one.
func toolCacheDir(env, name string) (string, error) {
	base := os.Getenv(env)
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("finding the build cache of %s: %w (set %s)", name, err, env)
		}
		base = filepath.Join(home, ".cache", "weightd")
	}
	return filepath.Join(base, name), nil
}

// goInstall is a set of programs that `go install pkg@version` builds from
// the Go module proxy into a cache directory.
type goInstall struct {
	// What names the build in errors ("containerd v2.4.2").
	What string
	// Dir receives the programs; its parent must be writable.
	Dir string
	// Pkgs are the packages, each pkg@version.
	Pkgs []string
	// LDFlags is go install's -ldflags; empty for none.
	LDFlags string
	// Bins are the programs' names, the last elements of Pkgs' paths.
	Bins []string
}

// built reports whether every program is in Dir, a regular executable
// file.
func (g goInstall) built() bool {
	for _, b := range g.Bins {
		if fi, err := os.Stat(filepath.Join(g.Dir, b)); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// run builds the programs unless they are all in Dir already. It runs `go
// install`, a build of each package's own module, so their dependencies
// stay out of weightd's go.mod. The programs are installed into a
// temporary directory beside Dir and renamed into place, so an interrupted
// build never leaves a half-written program under its real name; a lock
// file (Dir + ".lock") makes concurrent callers (test binaries) build once.
// The go command's output is returned in the error of a failed build.
func (g goInstall) run(ctx context.Context) error {
	if g.built() {
		return nil
	}
	parent := filepath.Dir(g.Dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	lock, err := os.OpenFile(g.Dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer lock.Close() // releases the flock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	if g.built() { // another process built them while this one waited
		return nil
	}
	if err := os.MkdirAll(g.Dir, 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(g.Dir)+"-build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	args := []string{"install"}
	if g.LDFlags != "" {
		args = append(args, "-ldflags", g.LDFlags)
	}
	cmd := exec.CommandContext(ctx, "go", append(args, g.Pkgs...)...)
	// Outside any module or workspace, with the caller's flags left out:
	// pkg@version builds the package's module as its go.mod says.
	cmd.Dir = tmp
	cmd.Env = append(os.Environ(), "GOBIN="+tmp, "GOWORK=off", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s (go install): %w\n%s", g.What, err, out)
	}
	for _, b := range g.Bins {
		if err := os.Rename(filepath.Join(tmp, b), filepath.Join(g.Dir, b)); err != nil {
			return fmt.Errorf("installing %s: %w", g.What, err)
		}
	}
	if !g.built() {
		return errors.New("installing " + g.What + ": a program is missing after go install")
	}
	return nil
}

// cachedTool returns the path of the one program install names, without
// building it: an error wrapping notBuilt, naming the make target that
// builds it, when it is not there.
func cachedTool(install func() (goInstall, error), notBuilt error, target string) (string, error) {
	g, err := install()
	if err != nil {
		return "", err
	}
	p := filepath.Join(g.Dir, g.Bins[0])
	if !g.built() {
		return p, fmt.Errorf("%w: no %s in %s (make %s builds it)", notBuilt, g.What, g.Dir, target)
	}
	return p, nil
}

// buildTool returns the path of the one program install names, building it
// unless it is there already.
func buildTool(ctx context.Context, install func() (goInstall, error)) (string, error) {
	g, err := install()
	if err != nil {
		return "", err
	}
	if err := g.run(ctx); err != nil {
		return "", err
	}
	return filepath.Join(g.Dir, g.Bins[0]), nil
}
