package p2p

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/time/rate"

	"github.com/weightd/weightd/pkg/peertls"
)

var (
	errRelayCut  = errors.New("relayed chunk cut short: it failed at the relay")
	errBusy      = errors.New("peer busy")
	errChunkBusy = errors.New("peer sent this chunk already")
	errSlow      = errors.New("peer too slow")
	errNotHeld   = errors.New("404 Not Found") // the peer holds none of it
)

// sentToError is errChunkBusy from an origin fetcher that named the peer
// it sent the chunk to (sentToHeader): that peer has it, or has it on its
// way.
type sentToError struct{ peer string }

func (e *sentToError) Error() string        { return errChunkBusy.Error() + ", to " + e.peer }
func (e *sentToError) Is(target error) bool { return target == errChunkBusy }

// requestTimeout bounds one request for n bytes: n at the slowest
// acceptable rate for each of the node's fills, which share its downlink,
// and a few seconds to start. A relayed copy (relay: the peer is still
// receiving the chunk) gets relayDeadlines times that.
func (s *Swarm) requestTimeout(n int64, relay bool) time.Duration {
	fills := max(1, int64(s.fills.Load()))
	d := 5*time.Second + time.Duration(n*fills*int64(time.Second)/s.cfg.MinRate)
	if relay {
		d *= relayDeadlines
	}
	return d
}

// relayDeadlines is how many whole-chunk deadlines a relayed copy has: it
// comes at its upstream's pace, at last a busy origin's, and another relay
// of the same upstream would be no faster. Bounded still, so that a peer
// cannot hold a request by trickling bytes.
const relayDeadlines = 4

// stateWait is how long a state request may wait for news at the peer.
const stateWait = time.Second

// errStateTooBig is a peer's chunk state longer than any state of the
// blob: it is not read further, and the peer is banned.
var errStateTooBig = errors.New("chunk state too big for the blob")

// readState asks a peer's chunk server for its state of d, a blob of
// chunks chunks. Once a state is known, the server answers when it differs
// (more chunks, or the origin role taken or given up) or after stateWait,
// so a chunk is known to its requesters within milliseconds of being
// verified. An answer longer than a state of the blob can be is refused
// before it is read past that (errStateTooBig): a peer could otherwise make
// it read and decode up to maxChunkStateBytes, 520 MiB, at every news.
func (s *Swarm) readState(ctx context.Context, addr string, d digest.Digest, chunks int, known bool, last PeerState) (PeerState, error) {
	ctx, cancel := context.WithTimeout(ctx, stateWait+5*time.Second)
	defer cancel()
	url := s.peerURL(addr, fmt.Sprintf(statePath, d))
	if known {
		url += fmt.Sprintf("?since=%d&wait=%s", countBits(last.Have), stateWait)
		// So do the chunks on their way to it: it relays them as they
		// come (pickFromPeers), and the origin fetchers do not fetch them
		// (nextFromOrigin).
		url += fmt.Sprintf("&fetching=%d", countBits(last.Fetching))
		if last.Origin {
			// An origin fetcher's first sends matter too: it is not
			// asked again for what it sent (pickFromPeers).
			url += fmt.Sprintf("&origin=1&sent=%d", countBits(last.Sent))
		} else {
			url += "&origin=0"
		}
		if len(last.Have) <= maxKnownParam {
			url += "&known=" + base64.RawURLEncoding.EncodeToString(last.Have)
		}
	}
	limit := maxPeerStateBytes(chunks)
	b, err := s.getSmall(ctx, url, limit)
	if errors.Is(err, errAnswerTooBig) {
		return PeerState{}, fmt.Errorf("chunk state from %s: %w of %d chunks, at most %d bytes: %w", addr, errStateTooBig, chunks, limit, err)
	}
	if err != nil {
		return PeerState{}, fmt.Errorf("chunk state from %s: %w", addr, err)
	}
	st, err := DecodePeerState(b)
	if err == nil {
		err = st.fillKnown(last)
	}
	return st, err
}

// maxKnownParam bounds the bitmap of known hashes a state request sends
// (16 Ki chunks, 32 GiB of 2 MiB chunks); a larger blob's states carry
// all their hashes.
const maxKnownParam = 2 << 10

// errAnswerTooBig is a peer's answer longer than its limit.
var errAnswerTooBig = errors.New("answer too big")

// getSmall GETs a small answer from a peer: 200 and at most limit bytes.
// An answer that says it is longer is not read at all, and one that does
// not say is read only to limit+1 bytes (errAnswerTooBig).
func (s *Swarm) getSmall(ctx context.Context, url string, limit int64) ([]byte, error) {
	resp, err := s.get(ctx, url, nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		if resp.StatusCode == http.StatusNotFound {
			return nil, errNotHeld
		}
		return nil, errors.New(resp.Status)
	}
	if resp.ContentLength > limit {
		return nil, fmt.Errorf("%w: %d bytes said, over %d", errAnswerTooBig, resp.ContentLength, limit)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%w: over %d bytes", errAnswerTooBig, limit)
	}
	return b, err
}

// get GETs url from a peer. An answer other than 200 comes with its body
// drained, for the connection's reuse: only its status and headers count.
func (s *Swarm) get(ctx context.Context, url string, header http.Header) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	maps.Copy(req.Header, header)
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		drain(resp.Body)
	}
	return resp, nil
}

// peerURL is the URL of path on the chunk server at addr.
func (s *Swarm) peerURL(addr, path string) string {
	if s.cfg.TLS != nil {
		return "https://" + addr + path
	}
	return "http://" + addr + path
}

// errNotThePeer is an answer from a chunk server whose certificate names
// another node than the member that advertises its address.
var errNotThePeer = errors.New("chunk server is not the member it is advertised by")

// peerIdentity is a swarm's transport under mutual TLS. Peers are asked by
// the chunk address they gossip, so the handshake can verify only that the
// server holds a certificate of the cluster's CA; peerIdentity then
// refuses its answer unless the node name in it is that of the one member
// advertising the address. A member cannot pass itself off as another, nor
// serve under a second, self-chosen member name (for the rendezvous of
// shared resolutions, say), from its own chunk server.
type peerIdentity struct {
	next http.RoundTripper
	dir  Directory
}

func (p peerIdentity) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := p.next.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	name := peertls.PeerName(resp.TLS)
	var claims []string
	for _, m := range p.dir.Members() {
		if m.Meta.ChunkAddr == req.URL.Host {
			claims = append(claims, m.Name)
		}
	}
	if len(claims) != 1 || claims[0] != name {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s is node %q, advertised by %q", errNotThePeer, req.URL.Host, name, claims)
	}
	return resp, nil
}

// drain reads the rest of a short error answer, best effort, so that its
// connection goes back to the pool: closing a body before its end closes
// the connection, and a busy peer answers often.
func drain(body io.Reader) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 4<<10))
}

// fetchChunk downloads chunk i of d from a peer into c, within timeout,
// and returns the peer's hash of it, its claim: in a header, or in a
// trailer for a relayed chunk (one the peer was still receiving); nil from
// an agent that sends none. With slowEnds, a copy that comes too slowly
// ends with errSlow (CopyTooSlow).
func (s *Swarm) fetchChunk(ctx context.Context, addr string, d digest.Digest, i int, timeout time.Duration, slowEnds, again bool, c *liveChunk) (claim []byte, err error) {
	ctx, watch := watchTransfer(ctx, timeout)
	defer watch.stop()
	watch.since, watch.slowEnds = s.cfg.Now(), slowEnds
	var header http.Header
	if again {
		header = http.Header{sendAgainHeader: {"1"}}
	}
	resp, err := s.get(ctx, s.peerURL(addr, fmt.Sprintf(chunkPath, d, i)), header)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		if resp.Header.Get(busyHeader) == "chunk" {
			if to := resp.Header.Get(sentToHeader); to != "" {
				return nil, &sentToError{peer: to}
			}
			return nil, errChunkBusy
		}
		return nil, errBusy
	case http.StatusNotFound:
		return nil, errNotHeld
	default:
		return nil, fmt.Errorf("chunk %d from %s: %s", i, addr, resp.Status)
	}
	n := int64(len(c.data()))
	relayed := resp.Header.Get(relayHeader) != ""
	if !relayed && resp.ContentLength != n {
		return nil, fmt.Errorf("chunk %d from %s: %d bytes, want %d", i, addr, resp.ContentLength, n)
	}
	c.share()
	if err := s.readInto(ctx, watch, resp.Body, c); err != nil {
		if relayed && (errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)) {
			err = fmt.Errorf("%w: %w", errRelayCut, err)
		}
		return nil, err
	}
	hash := resp.Header.Get(hashHeader)
	if relayed {
		// The hash comes in the trailer, after the body's end.
		if k, err := resp.Body.Read(make([]byte, 1)); k != 0 || !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("chunk %d from %s: over %d bytes, or cut: %v", i, addr, n, err)
		}
		hash = resp.Trailer.Get(hashHeader)
	} else if hash == "" {
		return nil, nil // an agent that predates the header
	}
	claim, err = hex.DecodeString(hash)
	if err != nil || len(claim) != sha256.Size {
		return nil, fmt.Errorf("chunk %d from %s: hash %q", i, addr, hash)
	}
	return claim, nil
}

// fetchOrigin downloads [off, off+len(c)) from the origin into c. Only a
// stall ends it: the origin has no stand-in, and a deadline would throw
// away the bytes a busy origin sent slowly, to ask for them again.
func (s *Swarm) fetchOrigin(ctx context.Context, origin Origin, off int64, c *liveChunk) error {
	ctx, watch := watchTransfer(ctx, 0)
	defer watch.stop()
	var body io.ReadCloser
	var err error
	if b, ok := origin.RangeOpener.(BoundedOpener); ok {
		body, err = b.OpenBoundedRange(ctx, off, int64(len(c.data())))
	} else {
		body, err = origin.OpenRange(ctx, off)
	}
	if err != nil {
		return err
	}
	defer body.Close()
	if pace := s.originPace(origin.Name); pace != nil {
		// At this node's part of the origin's limit; the download limit
		// paces it in readInto, as any transfer.
		body = &pacedReader{ReadCloser: body, ctx: ctx, limits: []*rate.Limiter{pace}}
	}
	c.share()
	return s.readInto(ctx, watch, body, c)
}

// stallTimeout is how long a transfer may go without a byte: a peer whose
// upload is shared by many still sends every few hundred milliseconds.
const stallTimeout = 5 * time.Second

var errStalled = errors.New("no bytes for " + stallTimeout.String())

// transferWatch ends a transfer at its deadline, or sooner when it stalls.
type transferWatch struct {
	timer        *time.Timer
	cancel       context.CancelCauseFunc
	stopDeadline context.CancelFunc
	since        time.Time // when the request went out, for slowEnds
	slowEnds     bool      // a copy that comes too slowly ends (CopyTooSlow)
}

// watchTransfer returns a context for one transfer that ends after timeout
// (none if 0) or once no bytes have come for stallTimeout (see progress).
func watchTransfer(ctx context.Context, timeout time.Duration) (context.Context, *transferWatch) {
	stopDeadline := context.CancelFunc(func() {})
	if timeout > 0 {
		ctx, stopDeadline = context.WithTimeout(ctx, timeout)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	w := &transferWatch{cancel: cancel, stopDeadline: stopDeadline}
	w.timer = time.AfterFunc(stallTimeout, func() { cancel(errStalled) })
	return ctx, w
}

// progress restarts the stall clock.
func (w *transferWatch) progress() { w.timer.Reset(stallTimeout) }

func (w *transferWatch) stop() {
	w.timer.Stop()
	w.cancel(nil)
	w.stopDeadline()
}

// readInto fills c from r, paced by the download limit, telling c's
// relays of each relayPiece.
func (s *Swarm) readInto(ctx context.Context, watch *transferWatch, r io.Reader, c *liveChunk) error {
	buf := c.data()
	n := int64(len(buf))
	for off := int64(0); off < n; {
		k := min(n-off, relayPiece)
		if s.download != nil {
			if err := s.download.WaitN(ctx, int(k)); err != nil {
				return err
			}
		}
		watch.progress()
		if got, err := io.ReadFull(r, buf[off:off+k]); err != nil {
			if ctx.Err() != nil {
				err = context.Cause(ctx) // the deadline, or errStalled
			}
			timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errStalled)
			if off+int64(got) > 0 && timedOut {
				// Bytes came, too slowly: a busy peer, not a dead one.
				return fmt.Errorf("%w: %d of %d bytes in time: %w", errSlow, off+int64(got), n, err)
			}
			return fmt.Errorf("reading at byte %d of %d: %w", off, n, err)
		}
		off += k
		c.progress(off)
		s.received.Add(k)
		if watch.slowEnds {
			now := s.cfg.Now()
			if run := now.Sub(watch.since); CopyTooSlow(off, run, s.downlinkPace(now)) {
				return fmt.Errorf("%w: %d of %d bytes in %s, under 1/%d of this node's downlink", errSlow, off, n, run.Round(time.Millisecond), slowCopyShare)
			}
		}
	}
	return nil
}

// downlinkPace is the pace this node has received chunks at lately, in
// bytes per second (paceMeter); 0 until it has been measured.
func (s *Swarm) downlinkPace(now time.Time) float64 {
	s.downMu.Lock()
	defer s.downMu.Unlock()
	return s.downlink.observe(now, s.received.Load())
}

// A copy too slow to wait for: a chunk asked of a peer that, two seconds
// on, has come at under a sixteenth of this node's downlink.
const (
	slowCopyAfter = 2 * time.Second
	slowCopyShare = 16
)

// CopyTooSlow reports whether a chunk that a peer has sent got bytes of in
// the running time since it was asked comes too slowly to wait for,
// downlink being this node's download pace in bytes per second (0: not
// measured yet, and no copy is too slow). Such a copy comes from a slow or
// busy sender, or relays one that does, and would hold this node, and
// every peer relaying from it, for many chunks' time: it is given up
// (errSlow) and asked of another holder. Under load a sixteenth of the
// downlink is no normal share: one fill has eight requests in flight at
// most, a server twelve uploads. The plan says which copies may be given
// up (mayGiveUp): not an origin fetcher's, which the origin paces, at most
// maxGiveUps per chunk, and none while the node fills several blobs. The
// simulation applies the same rule, its receiver's link standing for the
// downlink the agent measures.
func CopyTooSlow(got int64, running time.Duration, downlink float64) bool {
	return downlink > 0 && running >= slowCopyAfter && float64(got) < downlink/slowCopyShare*running.Seconds()
}
