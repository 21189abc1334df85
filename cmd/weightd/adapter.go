package main

import (
	"fmt"
	"time"

	"github.com/weightd/weightd/pkg/api"
)

// adapterCmd groups the LoRA adapter commands of the local agent's warm
// pool.
type adapterCmd struct {
	Ensure adapterEnsureCmd `cmd:"" help:"Make a LoRA adapter available on a warm server of its base model; print the server, its endpoint and the model name to send requests to."`
}

// adapterEnsureCmd asks the agent to load an adapter (or finds it loaded).
type adapterEnsureCmd struct {
	Base    string        `arg:"" help:"Reference of the base model the warm server keeps resident, as its pod's label names it."`
	Ref     string        `arg:"" help:"Reference of the adapter: hf://org/name@rev, oci://registry/repo:tag or https://host/path/model.json."`
	Name    string        `help:"Model name to serve the adapter under (default: derived from the reference)."`
	Pin     bool          `help:"Keep the adapter loaded: never evict it for another."`
	API     string        `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
	JSON    bool          `name:"json" help:"Print the answer as JSON."`
	Timeout time.Duration `help:"Give up after this long (0: no limit)." default:"0"`
}

func (c *adapterEnsureCmd) Run(e *env) error {
	client, ctx, cancel, err := e.client(c.API, c.Timeout)
	if err != nil {
		return err
	}
	defer cancel()
	ans, err := client.EnsureAdapter(ctx, api.AdapterRequest{Base: c.Base, Ref: c.Ref, Name: c.Name, Pin: c.Pin})
	if err != nil {
		return fmt.Errorf("ensuring adapter %s: %w", c.Ref, err)
	}
	if c.JSON {
		return printJSON(e.stdout, ans)
	}
	if ans.Loaded {
		fmt.Fprintf(e.stderr, "loaded in %.3fs\n", ans.Seconds)
	} else {
		fmt.Fprintln(e.stderr, "already loaded")
	}
	_, err = fmt.Fprintf(e.stdout, "server %s\nendpoint %s\nmodel %s\n", ans.Server, ans.Endpoint, ans.Model)
	return err
}
