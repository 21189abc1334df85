package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

// fetchCmd submits a reference to the agent and, with --wait, follows it to
// the end: an init container can use it as a readiness gate.
type fetchCmd struct {
	Ref     string        `arg:"" help:"Model reference: https://host/path/model.json (a manifest) or https://host/path/file#sha256:<hex>."`
	Wait    bool          `help:"Wait until the model is ready, showing progress on stderr; print its directory; fail if the fetch fails."`
	API     string        `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
	JSON    bool          `name:"json" help:"Print the job's status as JSON instead of text."`
	Timeout time.Duration `help:"With --wait, give up after this long (0: no limit)." default:"0"`
}

func (c *fetchCmd) Run(e *env) error {
	client, err := api.NewClient(c.API)
	if err != nil {
		return err
	}
	ctx := e.ctx
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	if !c.Wait {
		st, err := client.Fetch(ctx, c.Ref)
		if err != nil {
			return err
		}
		if c.JSON {
			return printJSON(e.stdout, st)
		}
		_, err = fmt.Fprintf(e.stdout, "job %s %s %s\n", st.ID, st.State, st.Ref)
		return err
	}
	st, err := fetchAndWait(ctx, client, c.Ref, e.stderr)
	if err != nil {
		return err
	}
	if c.JSON {
		if err := printJSON(e.stdout, st); err != nil {
			return err
		}
	}
	if st.State != prefetch.StateReady {
		return fmt.Errorf("fetching %s: %s", st.Ref, st.Error)
	}
	if !c.JSON {
		_, err = fmt.Fprintln(e.stdout, st.Dir)
	}
	return err
}

// fetchAndWait submits ref, shows its progress on w until the job ends and
// returns the final status (ready or failed).
func fetchAndWait(ctx context.Context, client *api.Client, ref string, w io.Writer) (prefetch.JobStatus, error) {
	st, err := client.Fetch(ctx, ref)
	if err != nil {
		return st, err
	}
	p := newProgress(w, st.Ref)
	final, err := client.Watch(ctx, st.ID, p.update)
	p.finish(final, err)
	return final, err
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
