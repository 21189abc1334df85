package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/weightd/weightd/pkg/content"
)

// Blob is a blob of a known size read with ranged requests: the bounds
// checks and bounded reads every source shares. Fetch makes one request for
// bytes [off, end), off < end, and returns the body from off.
type Blob struct {
	Size  int64
	Fetch func(ctx context.Context, off, end int64) (io.ReadCloser, error)
}

// OpenRange reads the blob from off to its end.
func (b Blob) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return b.openRange(ctx, off, b.Size)
}

// OpenBoundedRange reads bytes [off, off+n) of the blob, so that a chunk
// from the origin costs the origin exactly its bytes (the swarm reads chunks
// this way). The reader ends after n bytes.
func (b Blob) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	if n < 0 || off < 0 || n > b.Size-off {
		return nil, content.Permanent(fmt.Errorf("%w: bytes %d+%d outside a blob of %d bytes", content.ErrInvalid, off, n, b.Size))
	}
	body, err := b.openRange(ctx, off, off+n)
	if err != nil {
		return nil, err
	}
	return struct {
		io.Reader
		io.Closer
	}{io.LimitReader(body, n), body}, nil
}

func (b Blob) openRange(ctx context.Context, off, end int64) (io.ReadCloser, error) {
	if off < 0 || off > b.Size {
		return nil, content.Permanent(fmt.Errorf("%w: offset %d outside a blob of %d bytes", content.ErrInvalid, off, b.Size))
	}
	if off == end {
		return http.NoBody, nil
	}
	return b.Fetch(ctx, off, end)
}

// RangeHeader is the Range header for bytes [off, end) of a blob of size
// bytes: open-ended when end is the blob's end, unless closed is set (some
// registries do not understand "bytes=off-").
func RangeHeader(off, end, size int64, closed bool) func(http.Header) {
	return func(h http.Header) {
		spec := "bytes=" + strconv.FormatInt(off, 10) + "-"
		if end < size || closed {
			spec += strconv.FormatInt(end-1, 10)
		}
		h.Set("Range", spec)
		h.Set("Accept-Encoding", "identity")
	}
}

// ErrUnexpectedStatus is CheckRange's answer to a status it does not know:
// the source names the error.
var ErrUnexpectedStatus = errors.New("unexpected status")

// CheckRange checks a response to a GET of bytes [off, end) of a blob of
// size bytes: a 206 whose Content-Range is exactly that, a 200 with the
// whole blob, or a 416 (a permanent size mismatch). Any other status is
// ErrUnexpectedStatus.
func CheckRange(resp *http.Response, off, end, size int64) error {
	switch resp.StatusCode {
	case http.StatusPartialContent:
		cr := resp.Header.Get("Content-Range")
		first, last, total, err := ParseContentRange(cr)
		switch {
		case err != nil:
			return fmt.Errorf("Content-Range %q: %w", Truncate(cr), err)
		case total >= 0 && total != size:
			return content.Permanent(fmt.Errorf("%w: origin has %d bytes, want %d", content.ErrSizeMismatch, total, size))
		case first != off || last != end-1:
			return fmt.Errorf("Content-Range %q: want bytes %d-%d/%d", Truncate(cr), off, end-1, size)
		case resp.ContentLength >= 0 && resp.ContentLength != last-first+1:
			return fmt.Errorf("Content-Length %d disagrees with Content-Range %q", resp.ContentLength, Truncate(cr))
		}
		return nil
	case http.StatusOK:
		if resp.ContentLength >= 0 && resp.ContentLength != size {
			return content.Permanent(fmt.Errorf("%w: origin has %d bytes, want %d", content.ErrSizeMismatch, resp.ContentLength, size))
		}
		return nil
	case http.StatusRequestedRangeNotSatisfiable:
		return content.Permanent(fmt.Errorf("%w: origin refuses bytes %d- of a blob of %d bytes: HTTP %s", content.ErrSizeMismatch, off, size, resp.Status))
	default:
		return ErrUnexpectedStatus
	}
}

// ParseContentRange parses "bytes first-last/total"; total is -1 for "*".
func ParseContentRange(s string) (first, last, total int64, err error) {
	spec, ok := strings.CutPrefix(s, "bytes ")
	if !ok {
		return 0, 0, 0, errors.New("not a byte range")
	}
	rng, tot, ok := strings.Cut(spec, "/")
	if !ok {
		return 0, 0, 0, errors.New("no total")
	}
	a, z, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, errors.New("no range")
	}
	if first, err = parseNonNegative(a); err != nil {
		return 0, 0, 0, err
	}
	if last, err = parseNonNegative(z); err != nil {
		return 0, 0, 0, err
	}
	total = -1
	if tot != "*" {
		if total, err = parseNonNegative(tot); err != nil {
			return 0, 0, 0, err
		}
	}
	if last < first || (total >= 0 && last >= total) {
		return 0, 0, 0, errors.New("range out of order")
	}
	return first, last, total, nil
}

func parseNonNegative(s string) (int64, error) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a number", Truncate(s))
	}
	return strconv.ParseInt(s, 10, 64)
}
