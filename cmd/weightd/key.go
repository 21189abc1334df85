package main

import (
	"fmt"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/ref"
)

// keyCmd prints the node label of a reference: what a preferred node
// affinity matches to steer a pod to nodes that hold it.
type keyCmd struct {
	Ref   string `arg:"" help:"Reference as in the weightd.io/models annotation (hf://…, oci://…, https://…), or with --image a container image as a pod spec names it."`
	Image bool   `help:"REF is a container image as written in a pod spec (nginx, ghcr.io/org/app:v1), normalised like the kubelet does."`
}

func (c *keyCmd) Run(e *env) error {
	var r ref.Ref
	var err error
	if c.Image {
		r, err = podrequest.ImageRef(c.Ref)
	} else {
		r, err = ref.Parse(c.Ref)
	}
	if err != nil {
		return err
	}
	label := nodestate.Label(r.String())
	_, err = fmt.Fprintf(e.stdout, `# %s
key: %s
label: %s=%s
# a preferred node affinity on it, for a pod spec:
affinity:
  nodeAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      preference:
        matchExpressions:
        - key: %s
          operator: In
          values: [%q]
`, r.Redacted(), nodestate.Key(r.String()), label, nodestate.LabelReady, label, nodestate.LabelReady)
	return err
}
