package kube

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/util/workqueue"
)

// newPodQueue is a work queue of pod keys whose failed syncs are retried
// with exponential backoff from base up to most.
func newPodQueue(name string, base, most time.Duration) workqueue.TypedRateLimitingInterface[string] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](base, most),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: name},
	)
}

// runWorkers has workers goroutines sync the keys queue hands out, and runs
// beside next to them, until ctx ends; then it shuts the queue down and
// waits for them all. A failed sync is retried at the queue's rate, and
// failed (for logging) told of it, unless ctx has ended.
func runWorkers(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string], workers int,
	syncKey func(ctx context.Context, key string) error, failed func(key string, err error, retries int), beside func(context.Context)) {
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for work(ctx, queue, syncKey, failed) {
			}
		})
	}
	wg.Go(func() { beside(ctx) })
	<-ctx.Done()
	queue.ShutDown()
	wg.Wait()
}

// work syncs the next key of queue; false once the queue shuts down.
func work(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string],
	syncKey func(context.Context, string) error, failed func(key string, err error, retries int)) bool {
	key, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(key)
	if err := syncKey(ctx, key); err != nil {
		if ctx.Err() == nil {
			failed(key, err, queue.NumRequeues(key))
			queue.AddRateLimited(key)
		}
		return true
	}
	queue.Forget(key)
	return true
}
