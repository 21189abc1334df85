package oci

import (
	"context"
	"net/http"
)

// Requests to registries go over two pools of connections: one for blob
// reads, which stream megabytes, and one for everything short (pings,
// tokens, manifests, a blob's HEAD or first bytes). With one pool the blob
// reads take every idle connection, and a short request dials anew; on a
// link that blob reads keep full, its SYN is easily dropped in a queue and
// costs a second or more. With its own pool it finds the connection the
// last short request left idle, and costs a round trip.

type bulkKey struct{}

// bulk marks the requests made with ctx as blob reads.
func bulk(ctx context.Context) context.Context { return context.WithValue(ctx, bulkKey{}, true) }

// lanes sends blob reads through bulk, and other requests through short.
type lanes struct{ bulk, short http.RoundTripper }

// newLanes sends blob reads through base and other requests through
// short; with short nil, through a clone of base when it is an
// *http.Transport, else through base too.
func newLanes(base, short http.RoundTripper) http.RoundTripper {
	if short == nil {
		t, ok := base.(*http.Transport)
		if !ok {
			return base
		}
		short = t.Clone()
	}
	return lanes{bulk: base, short: short}
}

func (l lanes) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Context().Value(bulkKey{}) != nil {
		return l.bulk.RoundTrip(r)
	}
	return l.short.RoundTrip(r)
}
