package mirror

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/internal/byterange"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/oci"
)

// serveBlob serves a blob to a client the registry lets have it: from the
// cache when it is complete, otherwise streamed while the cache fetches it.
func (m *Mirror) serveBlob(w http.ResponseWriter, r *http.Request, registry string, rt route) {
	d := rt.digest
	auth := m.requestAuth(r, registry)
	small, aerr := m.confirmBlob(r.Context(), auth, registry, rt.repository, d, r.Method == http.MethodHead)
	if aerr != nil {
		m.m.request(routeBlob, outcomeOf(aerr))
		if r.Context().Err() == nil {
			aerr.write(w, r)
		}
		return
	}
	setBlobHeaders(w, d)
	if small != nil {
		m.serveSmall(w, r, d, small)
		return
	}
	if f, err := m.store.Open(d); err == nil {
		defer f.Close()
		m.m.request(routeBlob, outcomeHit)
		cw := &countingWriter{ResponseWriter: w}
		// ServeContent answers Range (206, 416) and HEAD, and sends the file
		// with sendfile.
		http.ServeContent(cw, r, "", time.Time{}, f)
		m.m.bytes.WithLabelValues("cache").Add(float64(cw.n))
		return
	} else if !errors.Is(err, content.ErrNotFound) {
		m.log.Warn("opening a blob in the cache", "digest", d, "err", err)
	}
	size, aerr := m.blobSize(r.Context(), auth, registry, rt.repository, d)
	if aerr != nil {
		m.m.request(routeBlob, outcomeOf(aerr))
		if r.Context().Err() == nil {
			aerr.write(w, r)
		}
		return
	}
	desc := content.Descriptor{Digest: d, Size: size}
	// A header this mirror does not take (several ranges, another unit),
	// or none, is the whole blob.
	start, end, err := byterange.Parse(r.Header.Get("Range"), size)
	ranged := err == nil
	if errors.Is(err, byterange.ErrUnsupported) {
		start, end, err = 0, size, nil
	}
	if err != nil {
		w.Header().Set("Content-Range", fmt.Sprintf("bytes */%d", size))
		m.m.request(routeBlob, outcomeError)
		(&apiError{status: http.StatusRequestedRangeNotSatisfiable, code: "UNSUPPORTED", message: "range not satisfiable"}).write(w, r)
		return
	}
	w.Header().Set("Accept-Ranges", "bytes")
	code := http.StatusOK
	if ranged {
		code = http.StatusPartialContent
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, size))
	}
	w.Header().Set("Content-Length", strconv.FormatInt(end-start, 10))
	if r.Method == http.MethodHead {
		// The size is known: answer without fetching.
		m.m.request(routeBlob, outcomeMiss)
		w.WriteHeader(code)
		return
	}
	dl, err := m.download(auth, registry, rt.repository, desc)
	if err != nil {
		// containerd goes on to the next host: the upstream itself.
		m.log.Info("not fetching a blob for the mirror; the client goes to the registry", "digest", d, "err", err)
		m.m.request(routeBlob, outcomeError)
		errUnavailable.write(w, r)
		return
	}
	m.m.request(routeBlob, outcomeMiss)
	m.stream(w, r, dl, start, end, code)
}

// directBlob is the largest blob the mirror asks the registry for whole
// when it must ask the registry anyway whether the client may have it: a
// config or small layer then costs one round trip, the answer being the
// blob, rather than a HEAD and then a fetch. A blob of unknown size is
// asked for its first directBlob bytes, which a longer one wastes.
const directBlob = 64 << 10

// maxDirect bounds the small blobs asked of the registry whole at once:
// each is held in memory. Beyond it a request takes the HEAD and the fetch.
const maxDirect = 32

// confirmBlob is authorize for blob d, in one round trip with its bytes
// where it can be: for a GET of a blob the cache lacks, of unknown size or
// at most directBlob, the registry is asked with the client's credentials
// for its first directBlob bytes. The answer confirms the client's access
// and, for a small blob, is the blob: it is returned, verified against d.
// It is nil when the blob is to come from the cache or a fetch, or the
// client asked with HEAD.
func (m *Mirror) confirmBlob(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest, head bool) ([]byte, *apiError) {
	if m.public.has(d) || m.grants.has(grantKey(auth, registry, repository, d)) {
		return nil, nil
	}
	size, known := m.localSize(d)
	if _, err := m.store.Stat(d); err == nil || (known && size > directBlob) || head {
		return nil, m.authorize(ctx, auth, registry, repository, d, false)
	}
	select {
	case m.direct <- struct{}{}:
		defer func() { <-m.direct }()
	default:
		return nil, m.authorize(ctx, auth, registry, repository, d, false)
	}
	n := int64(directBlob)
	if known {
		n = max(size, 1)
	}
	ctx, cancel := context.WithTimeout(ctx, m.opts.manifestTimeout)
	defer cancel()
	total, start, err := m.upstream.BlobStart(ctx, auth, registry, repository, d, n)
	if err != nil {
		return nil, m.unconfirmed(ctx, err, auth, registry, repository, d, errBlobUnknown)
	}
	whole := int64(len(start)) == total
	if whole && d.Algorithm().FromBytes(start) != d {
		m.log.Warn("the registry sent a blob that does not match its digest; not serving it", "registry", registry,
			"repository", repository, "digest", d)
		return nil, errUnavailable
	}
	m.allowed(auth, registry, repository, d)
	if !known {
		m.known.put(d, knownBlob{Size: total})
	}
	if !whole {
		return nil, nil
	}
	return start, nil
}

// serveSmall sends a small blob that the registry has just given the
// client, verified, and keeps it in the cache for the node's next clients
// and its peers. The cache is written after the response, apart from it: a
// fetch of the blob already running would hold the client's connection.
func (m *Mirror) serveSmall(w http.ResponseWriter, r *http.Request, d digest.Digest, b []byte) {
	m.m.request(routeBlob, outcomeMiss)
	cw := &countingWriter{ResponseWriter: w}
	http.ServeContent(cw, r, "", time.Time{}, bytes.NewReader(b))
	m.m.bytes.WithLabelValues("fetch").Add(float64(cw.n))
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx, cancel := context.WithTimeout(m.ctx, m.opts.fetchTimeout)
		defer cancel()
		if _, err := m.store.Fetch(ctx, content.Descriptor{Digest: d, Size: int64(len(b))}, cache.Bytes(b), nil); err != nil && m.ctx.Err() == nil {
			m.log.Warn("keeping a small blob in the cache", "digest", d, "err", err)
		}
	}()
}

func setBlobHeaders(w http.ResponseWriter, d digest.Digest) {
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Docker-Content-Digest", d.String())
	h.Set("ETag", `"`+d.String()+`"`)
}

// blobSize learns the size of a blob the cache does not hold whole: from a
// download in flight, from a manifest seen before, or from the upstream.
func (m *Mirror) blobSize(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest) (int64, *apiError) {
	if size, ok := m.localSize(d); ok {
		return size, nil
	}
	ctx, cancel := context.WithTimeout(ctx, m.opts.manifestTimeout)
	defer cancel()
	size, err := m.upstream.BlobSize(ctx, auth, registry, repository, d)
	if err == nil && size < 0 {
		err = fmt.Errorf("upstream says blob %s has %d bytes", d, size)
	}
	if err != nil {
		if !errors.Is(err, content.ErrNotFound) && ctx.Err() == nil {
			m.log.Warn("asking the upstream for a blob's size", "registry", registry, "repository", repository, "digest", d, "err", err)
		}
		return 0, m.upstreamErr(err, auth, registry, repository, errBlobUnknown)
	}
	m.known.put(d, knownBlob{Size: size})
	return size, nil
}

// localSize is the size of blob d as this node knows it without asking the
// registry: from a fetch in flight, or from a manifest seen before.
func (m *Mirror) localSize(d digest.Digest) (int64, bool) {
	if st, err := m.store.ChunkState(d); err == nil {
		return st.Size, true
	}
	if k, ok := m.known.get(d); ok {
		return k.Size, true
	}
	return 0, false
}

// maxDownloads bounds the blob fetches requests keep running at once.
const maxDownloads = 256

var errTooManyDownloads = fmt.Errorf("%d blob fetches already running", maxDownloads)

// failedFor is how long a blob whose fetch failed is answered 503 at once,
// without fetching again: a client cut short mid-blob reopens it at its
// offset through its hosts in order, and should find the registry next
// rather than the same failure.
const failedFor = 30 * time.Second

var errRecentlyFailed = errors.New("its fetch failed moments ago")

// Prioritizer is a blob source that can be told which byte a client is
// waiting on, so that it fetches the chunks from there first (the swarm
// fetches rarest first otherwise).
type Prioritizer interface {
	Want(off int64)
}

// download is one fetch of a blob into the cache that requests started; the
// requests streaming the blob wait on it.
type download struct {
	desc content.Descriptor
	src  content.RangeOpener
	done chan struct{} // closed when the fetch has ended; err is set before
	err  error

	mu   sync.Mutex
	wake chan struct{} // closed and replaced on every progress report
}

// progress is the fetch's content.Progress: it wakes the streaming requests
// without blocking.
func (dl *download) progress(_, _, _ int64) {
	dl.mu.Lock()
	close(dl.wake)
	dl.wake = make(chan struct{})
	dl.mu.Unlock()
}

func (dl *download) changed() <-chan struct{} {
	dl.mu.Lock()
	defer dl.mu.Unlock()
	return dl.wake
}

// want tells the source which byte a client waits on.
func (dl *download) want(off int64) {
	if p, ok := dl.src.(Prioritizer); ok {
		p.Want(off)
	}
}

// download returns the fetch of desc that requests share, starting it with
// auth if none runs (every request is authorised before it joins one). The fetch runs detached from the request, bounded by the fetch
// timeout, so that it completes into the cache even when every client has
// gone; the cache coalesces it with any other fetch of the blob.
func (m *Mirror) download(auth oci.RegistryAuth, registry, repository string, desc content.Descriptor) (*download, error) {
	running := func() (*download, error) {
		if m.closed {
			return nil, cache.ErrClosed
		}
		if dl, ok := m.downloads[desc.Digest]; ok && dl.desc.Size == desc.Size {
			return dl, nil
		}
		if at, ok := m.failed[desc.Digest]; ok {
			if time.Since(at) < failedFor {
				return nil, errRecentlyFailed
			}
			delete(m.failed, desc.Digest)
		}
		if len(m.downloads) >= maxDownloads {
			return nil, errTooManyDownloads
		}
		return nil, nil
	}
	m.mu.Lock()
	dl, err := running()
	m.mu.Unlock()
	if dl != nil || err != nil {
		return dl, err
	}
	// The sources are made outside the lock: the blob source is the
	// agent's, and may take its time.
	src := m.opts.blobSource(desc, registry, m.upstream.BlobOpener(auth, registry, repository, desc))
	m.mu.Lock()
	defer m.mu.Unlock()
	if dl, err := running(); dl != nil || err != nil {
		return dl, err // started by another request meanwhile
	}
	dl = &download{desc: desc, src: src, done: make(chan struct{}), wake: make(chan struct{})}
	m.downloads[desc.Digest] = dl
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		ctx, cancel := context.WithTimeout(m.ctx, m.opts.fetchTimeout)
		defer cancel()
		_, err := m.store.Fetch(ctx, desc, src, dl.progress)
		if err != nil {
			m.log.Warn("fetching a blob for the mirror", "registry", registry, "repository", repository, "digest", desc.Digest, "err", err)
			if errors.Is(err, content.ErrSizeMismatch) {
				m.known.forget(desc.Digest) // a manifest gave a wrong size
			}
		}
		m.mu.Lock()
		if m.downloads[desc.Digest] == dl {
			delete(m.downloads, desc.Digest)
		}
		if err != nil && m.ctx.Err() == nil {
			m.forgetOldFailures()
			m.failed[desc.Digest] = time.Now()
		}
		m.mu.Unlock()
		dl.err = err
		close(dl.done)
	}()
	return dl, nil
}

// forgetOldFailures drops the failures older than failedFor, so the map
// stays as small as the failures of the last moments; m.mu must be held.
func (m *Mirror) forgetOldFailures() {
	for d, at := range m.failed {
		if time.Since(at) >= failedFor {
			delete(m.failed, d)
		}
	}
}

// stream sends [start, end) of a blob being fetched, chunk by chunk as the
// cache has them, and from the complete file once it is committed. The
// status line and headers go out at once, before any chunk is fetched:
// containerd gives a mirror 30 s to answer with headers, then goes to the
// registry for good. The piece that ends the response is sent only after
// the whole blob has been verified against its digest: a fetch that fails
// cuts the response short, never completes it with wrong bytes, and the
// client's retry at its offset gets a 503 (failedFor) and moves on.
func (m *Mirror) stream(w http.ResponseWriter, r *http.Request, dl *download, start, end int64, code int) {
	d := dl.desc.Digest
	rc := http.NewResponseController(w)
	sentBytes := m.m.bytes.WithLabelValues("fetch")
	w.WriteHeader(code)
	if err := rc.Flush(); err != nil {
		return // the client is gone
	}
	send := func(f io.ReadSeeker, from, to int64) bool {
		if _, err := f.Seek(from, io.SeekStart); err != nil {
			m.log.Warn("seeking in a blob", "digest", d, "err", err)
			panic(http.ErrAbortHandler)
		}
		// io.CopyN hands an io.LimitedReader of the file to the connection,
		// which sends it with sendfile.
		n, err := io.CopyN(w, f, to-from)
		start += n
		sentBytes.Add(float64(n))
		if err != nil {
			return false // the client is gone
		}
		_ = rc.Flush()
		return true
	}
	poll := time.NewTicker(m.opts.pollInterval)
	defer poll.Stop()
	for {
		wake := dl.changed()
		finished := false
		select {
		case <-dl.done:
			finished = true
		default:
		}
		if finished && dl.err != nil {
			panic(http.ErrAbortHandler) // the client sees a short body
		}
		// Complete: the rest from the blob file.
		if f, err := m.store.Open(d); err == nil {
			send(f, start, end)
			f.Close()
			return
		} else if finished {
			// Fetched, yet gone already (evicted): nothing more to send.
			m.log.Warn("a blob fetched for the mirror is gone already", "digest", d, "err", err)
			panic(http.ErrAbortHandler)
		}
		if start < end {
			if next, ok := m.nextChunk(d, start, end); ok {
				f, off, n, err := m.store.OpenChunk(d, next)
				if err == nil {
					ok := send(f, start, min(end, off+n))
					f.Close()
					if !ok {
						return
					}
					continue
				}
			}
			dl.want(start)
		}
		select {
		case <-wake:
		case <-dl.done:
		case <-poll.C: // a chunk is marked present after its last progress report
		case <-r.Context().Done():
			return
		}
	}
}

// nextChunk says whether the chunk holding byte pos of the download in
// flight is present and may be sent: not when it holds the response's last
// byte, which waits for the whole blob to be verified, unless that chunk is
// the whole blob and hashed to its digest (a config or small layer need not
// wait for the commit's fsyncs).
func (m *Mirror) nextChunk(d digest.Digest, pos, end int64) (int, bool) {
	st, err := m.store.ChunkState(d)
	if err != nil || st.Complete || st.ChunkSize <= 0 {
		return 0, false
	}
	i := int(pos / st.ChunkSize)
	if !st.Has(i) || (int64(i+1)*st.ChunkSize >= end && !wholeBlobVerified(d, st)) {
		return 0, false
	}
	return i, true
}

// wholeBlobVerified reports whether the blob is one chunk whose recorded
// sha256 is the blob's digest: its bytes are the blob's.
func wholeBlobVerified(d digest.Digest, st cache.ChunkState) bool {
	return st.ChunkSize >= st.Size && d.Algorithm() == digest.SHA256 && hex.EncodeToString(st.Hash(0)) == d.Encoded()
}
