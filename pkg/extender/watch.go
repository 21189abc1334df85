package extender

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/weightd/weightd/pkg/nodestate"
)

// Watcher keeps a Cache current with the cluster's nodes through a node
// informer. Build it with NewWatcher, then call Run once.
type Watcher struct {
	client kubernetes.Interface
	cache  *Cache
	log    *slog.Logger
	synced atomic.Pointer[toolscache.ResourceEventHandlerRegistration]
}

// WatcherOption configures a Watcher.
type WatcherOption func(*Watcher)

// WatchLogger sets where the watcher logs nodes whose summary it ignored.
// The default discards.
func WatchLogger(l *slog.Logger) WatcherOption {
	return func(w *Watcher) {
		if l != nil {
			w.log = l
		}
	}
}

// NewWatcher returns a watcher that feeds c from client's nodes. It starts
// nothing.
func NewWatcher(client kubernetes.Interface, c *Cache, opts ...WatcherOption) *Watcher {
	w := &Watcher{client: client, cache: c, log: slog.New(slog.DiscardHandler)}
	for _, o := range opts {
		o(w)
	}
	return w
}

// Run lists and watches nodes until ctx ends, feeding the cache on every
// event. It returns nil when ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	if w.client == nil || w.cache == nil {
		return errors.New("extender: watcher without a client or cache")
	}
	factory := informers.NewSharedInformerFactoryWithOptions(w.client, 0, informers.WithTransform(stripNode))
	inf := factory.Core().V1().Nodes().Informer()
	reg, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    w.set,
		UpdateFunc: func(_, obj any) { w.set(obj) },
		DeleteFunc: w.delete,
	})
	if err != nil {
		return fmt.Errorf("extender: watching nodes: %w", err)
	}
	w.synced.Store(&reg)
	defer w.synced.Store(nil)
	inf.RunWithContext(ctx)
	return nil
}

// Synced reports whether the cache holds every node of the initial list
// (and is kept current since).
func (w *Watcher) Synced() bool {
	reg := w.synced.Load()
	return reg != nil && (*reg).HasSynced()
}

// WaitSynced waits until Synced or ctx ends.
func (w *Watcher) WaitSynced(ctx context.Context) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for !w.Synced() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the node informer to sync: %w", context.Cause(ctx))
		case <-t.C:
		}
	}
	return nil
}

func (w *Watcher) set(obj any) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	if err := w.cache.Set(n); err != nil {
		w.log.Warn("node cache state partly ignored", "node", n.Name, "err", err)
	}
}

func (w *Watcher) delete(obj any) {
	switch o := obj.(type) {
	case *corev1.Node:
		w.cache.Delete(o.Name)
	case toolscache.DeletedFinalStateUnknown:
		if n, ok := o.Obj.(*corev1.Node); ok {
			w.cache.Delete(n.Name)
		} else if _, name, err := toolscache.SplitMetaNamespaceKey(o.Key); err == nil {
			w.cache.Delete(name)
		}
	}
}

// stripNode keeps only what the extender reads of a Node, so the informer's
// own store stays small: name, resource version, weightd labels, the summary
// annotation and status.images.
func stripNode(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	out := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:            n.Name,
			UID:             n.UID,
			ResourceVersion: n.ResourceVersion,
		},
		Status: corev1.NodeStatus{Images: n.Status.Images},
	}
	for k, v := range n.Labels {
		if strings.HasPrefix(k, nodestate.LabelPrefix) {
			if out.Labels == nil {
				out.Labels = make(map[string]string)
			}
			out.Labels[k] = v
		}
	}
	if s, ok := n.Annotations[nodestate.SummaryAnnotation]; ok {
		out.Annotations = map[string]string{nodestate.SummaryAnnotation: s}
	}
	return out, nil
}
