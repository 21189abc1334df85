// Package byterange parses the Range header of a GET (RFC 9110, 14.2) for
// the one range of one resource that weightd's servers send: the registry
// mirror's blobs and the chunk server's chunks.
package byterange

import (
	"errors"
	"strconv"
	"strings"
)

var (
	// ErrUnsupported is a header of several ranges or another unit: a
	// server may ignore it and send the whole resource.
	ErrUnsupported = errors.New("not a single byte range")
	// ErrUnsatisfiable is a range that is malformed or lies outside the
	// resource: the answer is 416.
	ErrUnsatisfiable = errors.New("range not satisfiable")
)

// Parse parses h, a single "bytes=a-b", "bytes=a-" or "bytes=-n", for a
// resource of size bytes into [start, end), start < end.
func Parse(h string, size int64) (start, end int64, err error) {
	spec, found := strings.CutPrefix(h, "bytes=")
	if !found || strings.Contains(spec, ",") {
		return 0, 0, ErrUnsupported
	}
	a, b, found := strings.Cut(strings.TrimSpace(spec), "-")
	if !found {
		return 0, 0, ErrUnsatisfiable
	}
	if a == "" { // the last b bytes
		n, ok := number(b)
		if !ok || n == 0 || size <= 0 {
			return 0, 0, ErrUnsatisfiable
		}
		return max(size-n, 0), size, nil
	}
	start, ok := number(a)
	if !ok || start >= size {
		return 0, 0, ErrUnsatisfiable
	}
	end = size
	if b != "" {
		last, ok := number(b)
		if !ok || last < start {
			return 0, 0, ErrUnsatisfiable
		}
		end = min(last, size-1) + 1
	}
	return start, end, nil
}

// number parses digits alone (strconv takes a sign too) into an int64.
func number(s string) (int64, bool) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}
