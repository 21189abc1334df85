package kube

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/warmpool"
)

// published is a loaded-adapters annotation written (remove: removed).
type published struct {
	uid    types.UID
	value  string
	remove bool
}

// loop gives the pool the servers and writes the loaded-adapters
// annotations after a change settles, and every warmResync in case a
// change went unnoticed, until ctx ends.
func (s *warmSyncer) loop(ctx context.Context, dirty <-chan struct{}) {
	resync := time.NewTicker(warmResync)
	defer resync.Stop()
	var retry <-chan time.Time
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-dirty:
		case <-s.w.pool.Changed():
		case <-resync.C:
		case <-retry:
		}
		select { // let a burst settle
		case <-ctx.Done():
			return
		case <-time.After(s.w.cfg.interval):
		}
		select {
		case <-dirty:
		default:
		}
		s.discover()
		err := s.publish(ctx)
		retry = nil
		switch {
		case err != nil && ctx.Err() == nil:
			if !failing {
				s.w.cfg.logger.Warn("writing loaded adapters on warm server pods; retrying", "err", err)
			}
			failing = true
			retry = time.After(s.w.cfg.retryBase)
		case err == nil && failing:
			s.w.cfg.logger.Info("writing loaded adapters on warm server pods works again")
			failing = false
		}
	}
}

// discover lists the node's warm servers from the informer and gives them
// to the pool when they changed; every adapter request is then asked again.
func (s *warmSyncer) discover() {
	specs := []warmpool.ServerSpec{}
	bad := make(map[types.UID]bool)
	notAllowed := make(map[types.UID]bool)
	for _, obj := range s.indexer.List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || !podrequest.IsWarmServer(pod.Labels) || pod.DeletionTimestamp != nil || podFinished(pod) {
			continue
		}
		shared := s.w.cfg.sharedNamespaces[pod.Namespace]
		if !shared && !s.w.cfg.serverNamespaces[pod.Namespace] {
			notAllowed[pod.UID] = true
			if !s.refused[pod.UID] {
				s.refused[pod.UID] = true
				msg := fmt.Sprintf("namespace %s may not hold warm servers on this node (the agent's --warm-server-namespaces and --warm-shared-namespaces): this pod gets no adapters and no base pin", pod.Namespace)
				s.w.cfg.logger.Warn("ignoring a warm server in a namespace not allowed", "pod", pod.Namespace+"/"+pod.Name)
				ref := podRef(pod)
				s.recorder.Event(&ref, corev1.EventTypeWarning, ReasonWarmServerNotAllowed, msg)
			}
			continue
		}
		srv, err := podrequest.ParseWarmServer(pod.Annotations)
		if err != nil {
			bad[pod.UID] = true
			if fp := annotationsFingerprint(pod, warmAnnotations); s.invalid[pod.UID] != fp {
				s.invalid[pod.UID] = fp
				s.w.cfg.logger.Warn("invalid warm server annotation", "pod", pod.Namespace+"/"+pod.Name, "err", err)
				ref := podRef(pod)
				s.recorder.Event(&ref, corev1.EventTypeWarning, ReasonInvalidAnnotation, bound(err.Error()))
			}
			continue
		}
		if pod.Status.Phase != corev1.PodRunning || pod.Status.PodIP == "" {
			continue
		}
		specs = append(specs, warmpool.ServerSpec{
			Pod: pod.Namespace + "/" + pod.Name, UID: string(pod.UID),
			Base: srv.Base.String(), Runtime: srv.Runtime,
			Endpoint: "http://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(srv.Port)),
			Slots:    srv.Slots, MaxRank: srv.MaxRank, Shared: shared,
		})
	}
	for uid := range s.invalid {
		if !bad[uid] {
			delete(s.invalid, uid) // fixed or gone: reported again if it breaks again
		}
	}
	for uid := range s.refused {
		if !notAllowed[uid] {
			delete(s.refused, uid)
		}
	}
	slices.SortFunc(specs, func(a, b warmpool.ServerSpec) int { return cmp.Compare(a.Pod, b.Pod) })
	if s.servers != nil && slices.Equal(specs, s.servers) {
		return
	}
	s.w.cfg.logger.Info("warm servers", "servers", len(specs))
	s.w.pool.SetServers(slices.Clone(specs))
	s.servers = specs
	s.w.discovered.Store(true)

	s.w.mu.Lock()
	var keys []string
	for key, st := range s.w.adapters {
		if !st.invalid {
			st.due++
			keys = append(keys, key)
		}
	}
	s.w.mu.Unlock()
	for _, key := range keys {
		s.queue.Add(key)
	}
}

// publish writes, on each healthy warm server's pod, the adapters loaded in
// it, where the pod shows something else; and removes the annotation from
// pods that are no longer warm servers.
func (s *warmSyncer) publish(ctx context.Context) error {
	want := make(map[string]string)
	for _, srv := range s.w.pool.Servers() {
		if !srv.Healthy {
			continue // until the pool knows what it holds, the pod keeps what it shows
		}
		names := make([]string, len(srv.Adapters))
		for i, a := range srv.Adapters {
			names[i] = a.Name
		}
		want[srv.Pod] = nodestate.EncodeAdapters(names)
	}
	var errs []error
	seen := make(map[string]bool)
	for _, obj := range s.indexer.List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.DeletionTimestamp != nil {
			continue
		}
		key := pod.Namespace + "/" + pod.Name
		have, has := pod.Annotations[nodestate.LoadedAdaptersAnnotation]
		value, wanted := want[key]
		remove := !wanted && has && !podrequest.IsWarmServer(pod.Labels)
		if (!wanted || have == value) && !remove {
			continue // right, or not ours to change now
		}
		seen[key] = true
		p := published{uid: pod.UID, value: value, remove: remove}
		if s.published[key] == p {
			continue // written; the informer has not shown it yet
		}
		var v any = value
		if remove {
			v = nil
		}
		if err := patchAnnotations(ctx, s.w.client, pod, map[string]any{nodestate.LoadedAdaptersAnnotation: v}); err != nil {
			if !apierrors.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("writing loaded adapters on pod %s: %w", key, err))
			}
			continue
		}
		s.published[key] = p
	}
	for key := range s.published {
		if !seen[key] {
			delete(s.published, key) // shown, or no longer wanted
		}
	}
	return errors.Join(errs...)
}
