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
	Ref      string        `arg:"" help:"Reference: oci://registry/repo:tag (an image or ModelPack model), hf://org/name@rev (a hub model), https://host/path/model.json (a manifest) or https://host/path/file#sha256:<hex>."`
	Priority string        `help:"Queue priority: pod (a pod waits for it), normal or background." default:"normal" enum:"background,normal,pod"`
	Wait     bool          `help:"Wait until the model is ready, showing progress on stderr; print its directory; fail if the fetch fails."`
	API      string        `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
	JSON     bool          `name:"json" help:"Print the job's status as JSON instead of text."`
	Timeout  time.Duration `help:"With --wait, give up after this long (0: no limit)." default:"0"`
}

func (c *fetchCmd) Run(e *env) error {
	client, ctx, cancel, err := e.client(c.API, c.Timeout)
	if err != nil {
		return err
	}
	defer cancel()
	if !c.Wait {
		st, err := client.Submit(ctx, api.FetchRequest{Ref: c.Ref, Priority: c.Priority})
		if err != nil {
			return err
		}
		if c.JSON {
			return printJSON(e.stdout, st)
		}
		_, err = fmt.Fprintf(e.stdout, "job %s %s %s\n", st.ID, st.State, st.Ref)
		return err
	}
	st, err := fetchAndWait(ctx, client, api.FetchRequest{Ref: c.Ref, Priority: c.Priority}, e.stderr)
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

// fetchAndWait submits req, shows its progress on w until the job ends and
// returns the final status (ready or failed).
func fetchAndWait(ctx context.Context, client *api.Client, req api.FetchRequest, w io.Writer) (prefetch.JobStatus, error) {
	st, err := client.Submit(ctx, req)
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

// cancelCmd cancels a fetch job of the local agent.
type cancelCmd struct {
	ID  string `arg:"" help:"Job ID, as 'weightd fetch' or 'weightd status' print it."`
	API string `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
}

func (c *cancelCmd) Run(e *env) error {
	client, err := api.NewClient(c.API)
	if err != nil {
		return err
	}
	st, err := client.Cancel(e.ctx, c.ID)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(e.stdout, "job %s %s %s\n", st.ID, st.State, st.Ref)
	return err
}
