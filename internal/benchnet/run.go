package benchnet

import (
	"context"
	"errors"
	"flag"
	"os"
	"os/signal"
	"syscall"
)

// QuickDefaults sets each flag named in defaults to its value unless the
// command line set it: the sizes of a bench's -quick run.
func QuickDefaults(defaults map[string]string) error {
	set := make(map[string]bool)
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for name, v := range defaults {
		if !set[name] {
			if err := flag.Set(name, v); err != nil {
				return err
			}
		}
	}
	return nil
}

// RunInterruptible runs run under a context that the first SIGINT or
// SIGTERM cancels, so that run tears down what it built; a second signal
// kills the process at once. A failure caused by the interruption is
// reported as such.
func RunInterruptible(run func(context.Context) error) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop) // after the first signal, a second one kills
	err := run(ctx)
	if ctx.Err() != nil {
		return errors.New("interrupted; everything was torn down")
	}
	return err
}
