package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/weightd/weightd/pkg/api"
)

// statusCmd prints a short summary of the agent.
type statusCmd struct {
	API  string `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
	JSON bool   `name:"json" help:"Print the agent's status as JSON."`
}

func (c *statusCmd) Run(e *env) error {
	client, err := api.NewClient(c.API)
	if err != nil {
		return err
	}
	st, err := client.Status(e.ctx)
	if err != nil {
		return err
	}
	if c.JSON {
		return printJSON(e.stdout, st)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	u := st.Cache
	fmt.Fprintf(tw, "agent\tweightd %s at %s\n", st.Version, c.API)
	fmt.Fprintf(tw, "cache\t%s: %s in %d blobs, %s partial\n", u.Root, formatBytes(u.Bytes), u.Blobs, formatBytes(u.PartialBytes))
	fmt.Fprintf(tw, "budget\t%s, %s free on disk\n", formatBytes(u.BudgetBytes), formatBytes(u.DiskFree))
	fmt.Fprintf(tw, "downloads\t%d in flight\n", len(u.InFlight))
	for _, f := range u.InFlight {
		fmt.Fprintf(tw, "\t%s\t%s / %s (%.0f%%)\tfor %s\n", f.Digest, formatBytes(f.Done), formatBytes(f.Size), percent(f.Done, f.Size), f.HeldFor.Round(time.Second))
	}
	fmt.Fprintf(tw, "peers\t%d\n", len(st.Peers))
	for _, p := range st.Peers {
		fmt.Fprintf(tw, "\t%s\t%s\t%s\n", p.Name, p.ChunkAddr, p.Zone)
	}
	fmt.Fprintf(tw, "jobs\t%d\n", len(st.Jobs))
	for _, j := range st.Jobs {
		detail := j.Dir
		if j.Error != "" {
			detail = j.Error
		}
		fmt.Fprintf(tw, "\t%s\t%s\t%s / %s\t%s\t%s\n", j.ID, j.State, formatBytes(j.BytesDone), formatBytes(j.BytesTotal), modelName(j), detail)
	}
	return tw.Flush()
}
