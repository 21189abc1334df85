package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/warmpool"
)

// KubeConfig is the Kubernetes part of the agent's configuration. Zero
// values mean the defaults, so that a configuration built in code (the demo,
// tests) needs none of it.
type KubeConfig struct {
	Kubeconfig         string        `help:"kubeconfig file of the cluster; empty: the in-cluster configuration when KUBERNETES_SERVICE_HOST is set, else Kubernetes features (pod intake, node labels) are off." env:"WEIGHTD_KUBECONFIG" type:"path"`
	KubeQPS            float32       `name:"kube-qps" help:"Most requests per second to the Kubernetes API server, on average (0: 5)." env:"WEIGHTD_KUBE_QPS"`
	KubeBurst          int           `name:"kube-burst" help:"Most requests to the Kubernetes API server in a burst (0: 10)." env:"WEIGHTD_KUBE_BURST"`
	NodeUpdateInterval time.Duration `help:"Least time between two writes of this node's cache labels and summary (0: 5s); progress alone is written at most every 6 intervals." env:"WEIGHTD_NODE_UPDATE_INTERVAL"`
	// One agent, elected with a Lease, counts every node's progress on the
	// PrefetchPolicies into their status.
	PolicyLeaseNamespace  string        `help:"Namespace of the Lease that elects the agent that writes the PrefetchPolicy counts (empty: weightd-system)." env:"WEIGHTD_POLICY_LEASE_NAMESPACE"`
	PolicySummaryInterval time.Duration `help:"Least time between two writes of one PrefetchPolicy's counts by the elected agent (0: 10s)." env:"WEIGHTD_POLICY_SUMMARY_INTERVAL"`
	// A warm server receives other pods' adapters and pins its base in the
	// node's cache: which pods may be one is the operator's to say.
	WarmServerNamespaces []string `help:"With --warm: namespaces whose pods labelled weightd.io/warm-server are warm servers for the pods of their own namespace (a labelled pod elsewhere is ignored, with a Warning Event)." env:"WEIGHTD_WARM_SERVER_NAMESPACES"`
	WarmSharedNamespaces []string `help:"With --warm: namespaces whose warm servers serve the pods of every namespace (a shared inference namespace)." env:"WEIGHTD_WARM_SHARED_NAMESPACES"`
}

// kubeSide is the agent's Kubernetes side: the pod intake, the node
// publisher, the node-group policy controller and its elected summarizer
// and, with a warm pool, its warm servers and adapter requests, each run in
// the agent's errgroup.
// They watch the node's pods and Node, and record Events, through shared.
type kubeSide struct {
	shared    *kube.Shared
	intake    *kube.PodIntake
	publisher *kube.NodePublisher
	policy    *policy.Controller
	summary   *policy.Summarizer
	warm      *kube.WarmPods // nil without a warm pool
	events    *kube.NodeEvents
	volumes   *kube.PodVolumes
}

// cluster is the API server the agent talks to, and this node's name in it.
type cluster struct {
	rest   *rest.Config
	client *kubernetes.Clientset
	node   string
}

// connect builds the clients of the cluster cfg names and settles this
// node's name; nil when no cluster is configured (one info line says so).
func connect(cfg KubeConfig, node, version string, log *slog.Logger) (*cluster, error) {
	if cfg.KubeQPS < 0 || cfg.KubeBurst < 0 || cfg.NodeUpdateInterval < 0 || cfg.PolicySummaryInterval < 0 {
		return nil, fmt.Errorf("--kube-qps, --kube-burst, --node-update-interval and --policy-summary-interval must not be negative")
	}
	rc, err := kube.RESTConfig(cfg.Kubeconfig, cfg.KubeQPS, cfg.KubeBurst, "weightd/"+version)
	if errors.Is(err, kube.ErrNoCluster) {
		log.Info("Kubernetes features off: no --kubeconfig and not in a pod")
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if node == "" {
		if cfg.Kubeconfig == "" {
			// In a pod the hostname is the pod's name, not the node's.
			return nil, errors.New("--node-name (WEIGHTD_NODE_NAME) must name this node when running in a pod: set it from spec.nodeName")
		}
		if node, err = os.Hostname(); err != nil {
			return nil, fmt.Errorf("--node-name is empty and the hostname unknown: %w", err)
		}
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("building the Kubernetes client: %w", err)
	}
	return &cluster{rest: rc, client: client, node: node}, nil
}

// zone is the node's topology.kubernetes.io/zone label, "" when it has
// none: a DaemonSet cannot hand a node's labels to its pods, so the swarm's
// zone comes from here when --zone is not set.
func (c *cluster) zone(ctx context.Context) (string, error) {
	n, err := c.client.CoreV1().Nodes().Get(ctx, c.node, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("reading node %s: %w", c.node, err)
	}
	return n.Labels[corev1.LabelTopologyZone], nil
}

// newKube builds the Kubernetes side on c, or returns nil when there is no
// cluster (c nil). pool is the warm pool, nil when off. It starts only the
// shared event broadcaster, which close stops.
func newKube(c *cluster, cfg KubeConfig, version string, queue *prefetch.Queue, store *cache.Store, pool *warmpool.Pool, among amongFirst, log *slog.Logger, reg prometheus.Registerer) (_ *kubeSide, err error) {
	if c == nil {
		return nil, nil
	}
	rc, client, node := c.rest, c.client, c.node
	// client-go logs through klog: send it to the agent's log, quietly (a
	// restarting API server makes the informers say so every few seconds).
	klog.SetSlogLogger(log.With("component", "client-go"))

	kl := log.With("component", "kube", "node", node)
	interval := cfg.NodeUpdateInterval
	if interval == 0 {
		interval = kube.DefaultNodeInterval
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("building the dynamic Kubernetes client: %w", err)
	}
	k := &kubeSide{shared: kube.NewShared(client, node)}
	defer func() {
		if err != nil {
			k.close()
		}
	}()
	if k.volumes, err = kube.NewPodVolumes(client, node, k.shared, log.With("component", "csi", "node", node)); err != nil {
		return nil, err
	}
	if k.events, err = kube.NewNodeEvents(client, node, k.shared); err != nil {
		return nil, err
	}
	if k.intake, err = kube.NewPodIntake(client, node, queue, kube.WithIntakeLogger(kl), kube.WithIntakeRegisterer(reg), kube.WithIntakeShared(k.shared)); err != nil {
		return nil, err
	}
	pubOpts := []kube.PublisherOption{kube.WithNodeInterval(interval, 6*interval), kube.WithPublisherLogger(kl), kube.WithPublisherShared(k.shared)}
	if pool != nil {
		if len(cfg.WarmServerNamespaces)+len(cfg.WarmSharedNamespaces) == 0 {
			log.Info("warm pool on, but no namespace may hold warm servers: set --warm-server-namespaces or --warm-shared-namespaces")
		}
		if k.warm, err = kube.NewWarmPods(client, node, pool, kube.WithWarmLogger(kl.With("part", "warm")),
			kube.WithWarmServerNamespaces(cfg.WarmServerNamespaces...), kube.WithWarmSharedNamespaces(cfg.WarmSharedNamespaces...),
			kube.WithWarmShared(k.shared)); err != nil {
			return nil, err
		}
		pubOpts = append(pubOpts, kube.WithWarmBases(k.warm.Bases))
	}
	if k.publisher, err = kube.NewNodePublisher(client, node, queue, store, pubOpts...); err != nil {
		return nil, err
	}
	pcfg := policy.DefaultConfig()
	pcfg.Logger, pcfg.Registerer = log.With("component", "policy", "node", node), reg
	pcfg.Recorder, pcfg.Nodes = k.shared.Recorder, k.shared.Nodes
	if k.policy, err = policy.New(node, client, dyn, policy.FromQueue(queue), store, pcfg); err != nil {
		return nil, err
	}
	scfg := policy.DefaultSummaryConfig()
	scfg.Logger, scfg.Registerer = pcfg.Logger, reg
	if cfg.PolicyLeaseNamespace != "" {
		scfg.LeaseNamespace = cfg.PolicyLeaseNamespace
	}
	if cfg.PolicySummaryInterval > 0 {
		scfg.Interval = cfg.PolicySummaryInterval
	}
	if among != nil {
		lease := scfg.LeaseNamespace + "/" + scfg.LeaseName
		scfg.Candidate = func() bool { return among(lease, summaryCandidates) }
	}
	meta, err := metadata.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("building the metadata Kubernetes client: %w", err)
	}
	if k.summary, err = policy.NewSummarizer(node, client, dyn, meta, scfg); err != nil {
		return nil, err
	}
	log.Info("Kubernetes features on", "node", node, "api-server", rc.Host)
	return k, nil
}

// amongFirst says whether this agent is among the first k of the gossip
// members in rendezvous order of key (p2p.Membership.AmongFirst).
type amongFirst func(key string, k int) bool

// summaryCandidates is how many agents campaign for the policy summary's
// Lease when gossip tells them apart: one leads and two stand by, as in a
// control plane, and the Lease is read by three, not by every node.
const summaryCandidates = 3

// runs are the components to run in the agent's errgroup. Each returns only
// when ctx ends: an API server that fails never stops the agent.
func (k *kubeSide) runs() []func(context.Context) error {
	if k == nil {
		return nil
	}
	runs := []func(context.Context) error{k.intake.Run, k.publisher.Run, k.policy.Run, k.summary.Run, k.events.Run, k.volumes.Run}
	if k.warm != nil {
		runs = append(runs, k.warm.Run)
	}
	return runs
}

// close stops the shared informers and sends the Events recorded so far,
// once every component has returned.
func (k *kubeSide) close() {
	if k != nil {
		k.shared.Close()
	}
}

// nodeEvent records an Event on the agent's Node; false when it was dropped.
func (k *kubeSide) nodeEvent(eventType, reason, message string) bool {
	return k.events.Event(eventType, reason, message)
}

// announceVolume is the CSI plugin's csi.Config.Announce: nil without a
// cluster.
func (k *kubeSide) announceVolume() func(context.Context, csi.Published) {
	if k == nil {
		return nil
	}
	return k.volumes.Announce
}
