package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/mirror"
)

// restoreHostsCmd undoes, on one node, what the agent's registry mirror did
// to containerd's config_path (mirror.ConfigureHosts): each registry's
// hosts.toml.weightd-backup is put back, or the hosts.toml weightd wrote is
// removed. A hosts.toml weightd did not write is left alone, so running it
// twice does nothing the second time. The chart's post-delete hook runs it
// on every node (charts/weightd/templates/cleanup.yaml): a DaemonSet
// whose init container restores and whose container then holds (--hold),
// and a Job that waits for that DaemonSet to be ready everywhere
// (--wait-daemonset), since the image has no shell to wait with.
type restoreHostsCmd struct {
	HostsDir      string        `help:"containerd's registry config_path, where the agent wrote hosts.toml files (the agent's --hosts-dir)." env:"WEIGHTD_HOSTS_DIR" type:"path"`
	Registries    []string      `help:"Registries whose hosts.toml to restore, host[:port], comma-separated (the agent's --mirror-registries)." env:"WEIGHTD_MIRROR_REGISTRIES" sep:","`
	Config        string        `help:"The agent's YAML configuration file: its agent: hosts-dir and mirror-registries fill in what the flags and environment leave empty." type:"existingfile" placeholder:"FILE"`
	Hold          bool          `help:"After restoring, wait until terminated (SIGTERM), then exit 0: the container of a DaemonSet, which must not exit."`
	WaitDaemonSet string        `name:"wait-daemonset" help:"Restore nothing: wait until every pod of this DaemonSet (whose pods restore their nodes) is ready on every node it runs on, then exit 0." placeholder:"NAME"`
	Namespace     string        `help:"Namespace of --wait-daemonset (default: POD_NAMESPACE, else this pod's service account namespace)." env:"POD_NAMESPACE"`
	Kubeconfig    string        `help:"kubeconfig file for --wait-daemonset; empty: the in-cluster configuration." env:"WEIGHTD_KUBECONFIG" type:"path"`
	Interval      time.Duration `help:"How often --wait-daemonset asks the API server." default:"2s"`
}

// saNamespaceFile is where the kubelet mounts a pod's namespace.
const saNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

func (c *restoreHostsCmd) Run(e *env) error {
	if c.WaitDaemonSet != "" {
		if c.HostsDir != "" || len(c.Registries) > 0 || c.Config != "" || c.Hold {
			return errors.New("restore-hosts: --wait-daemonset restores nothing: give it without --hosts-dir, --registries, --config and --hold")
		}
		return c.wait(e)
	}
	if err := c.fromConfig(); err != nil {
		return err
	}
	if len(c.Registries) > 0 {
		if c.HostsDir == "" {
			return errors.New("restore-hosts: no --hosts-dir (containerd's registry config_path), in the flags, WEIGHTD_HOSTS_DIR or --config")
		}
		if err := mirror.RestoreHosts(c.HostsDir, c.Registries); err != nil {
			return fmt.Errorf("restore-hosts: %w", err)
		}
		fmt.Fprintf(e.stdout, "restore-hosts: containerd's hosts.toml restored in %s for %s\n", c.HostsDir, strings.Join(c.Registries, ", "))
	} else if !c.Hold {
		return errors.New("restore-hosts: no registries to restore: give --registries, WEIGHTD_MIRROR_REGISTRIES or --config")
	}
	if c.Hold {
		<-e.ctx.Done()
	}
	return nil
}

// fromConfig fills HostsDir and Registries, where they are empty, from the
// agent's configuration file (keys under agent:, nested keys joined with
// '-', as the agent reads them).
func (c *restoreHostsCmd) fromConfig() error {
	if c.Config == "" {
		return nil
	}
	b, err := os.ReadFile(c.Config)
	if err != nil {
		return fmt.Errorf("restore-hosts: %w", err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("restore-hosts: config %s: %w", c.Config, err)
	}
	keys := map[string]any{}
	flattenValues("", doc, keys)
	if v, ok := keys["agent-hosts-dir"]; ok && c.HostsDir == "" {
		s, ok := v.(string)
		if !ok {
			return fmt.Errorf("restore-hosts: config %s: agent hosts-dir is %T, want a string", c.Config, v)
		}
		c.HostsDir = s
	}
	if v, ok := keys["agent-mirror-registries"]; ok && len(c.Registries) == 0 {
		switch v := v.(type) {
		case string:
			for _, r := range strings.Split(v, ",") {
				if r = strings.TrimSpace(r); r != "" {
					c.Registries = append(c.Registries, r)
				}
			}
		case []any:
			for _, r := range v {
				s, ok := r.(string)
				if !ok {
					return fmt.Errorf("restore-hosts: config %s: agent mirror-registries holds %T, want strings", c.Config, r)
				}
				c.Registries = append(c.Registries, s)
			}
		default:
			return fmt.Errorf("restore-hosts: config %s: agent mirror-registries is %T, want a list or a comma-separated string", c.Config, v)
		}
	}
	return nil
}

func flattenValues(prefix string, m map[string]any, into map[string]any) {
	for k, v := range m {
		if child, ok := v.(map[string]any); ok {
			flattenValues(prefix+k+"-", child, into)
			continue
		}
		into[prefix+k] = v
	}
}

func (c *restoreHostsCmd) wait(e *env) error {
	ns := c.Namespace
	if ns == "" {
		b, err := os.ReadFile(saNamespaceFile)
		if err != nil {
			return fmt.Errorf("restore-hosts: no --namespace for --wait-daemonset, and not in a pod: %w", err)
		}
		ns = strings.TrimSpace(string(b))
	}
	rc, err := kube.RESTConfig(c.Kubeconfig, 0, 0, "weightd-restore-hosts/"+version)
	if err != nil {
		return fmt.Errorf("restore-hosts: %w", err)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("restore-hosts: %w", err)
	}
	interval := c.Interval
	if interval <= 0 {
		interval = 2 * time.Second
	}
	return waitDaemonSetReady(e.ctx, cs, ns, c.WaitDaemonSet, interval, e.stdout)
}

// waitDaemonSetReady returns once the DaemonSet ns/name has seen its latest
// spec and has a ready pod of it on every node it is to run on. A
// DaemonSet not there yet, or an API server that does not answer, is
// waited for; only ctx ends the wait otherwise. It says on out what it
// waits for whenever that changes.
func waitDaemonSetReady(ctx context.Context, cs kubernetes.Interface, ns, name string, interval time.Duration, out io.Writer) error {
	last := ""
	say := func(format string, args ...any) {
		if s := fmt.Sprintf(format, args...); s != last {
			fmt.Fprintln(out, s)
			last = s
		}
	}
	for {
		ds, err := cs.AppsV1().DaemonSets(ns).Get(ctx, name, metav1.GetOptions{})
		switch {
		case err == nil:
			st := ds.Status
			if st.ObservedGeneration >= ds.Generation && st.UpdatedNumberScheduled == st.DesiredNumberScheduled && st.NumberReady == st.DesiredNumberScheduled {
				say("restore-hosts: daemonset %s/%s is ready on all %d nodes", ns, name, st.DesiredNumberScheduled)
				return nil
			}
			if st.ObservedGeneration < ds.Generation {
				say("restore-hosts: waiting for the daemonset controller to see %s/%s", ns, name)
			} else {
				say("restore-hosts: waiting for daemonset %s/%s: %d of %d nodes ready", ns, name, st.NumberReady, st.DesiredNumberScheduled)
			}
		case ctx.Err() != nil:
		case apierrors.IsNotFound(err):
			say("restore-hosts: waiting for daemonset %s/%s to be created", ns, name)
		default:
			say("restore-hosts: asking for daemonset %s/%s: %v", ns, name, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("restore-hosts: waiting for daemonset %s/%s: %w", ns, name, ctx.Err())
		case <-time.After(interval):
		}
	}
}
