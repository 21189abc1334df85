package hf

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strings"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// treeEntry is one entry of a tree listing: a file or a directory.
type treeEntry struct {
	Type string   `json:"type"`
	OID  string   `json:"oid"`
	Size int64    `json:"size"`
	Path string   `json:"path"`
	LFS  *treeLFS `json:"lfs"`
}

type treeLFS struct {
	OID         string `json:"oid"` // sha256, hex
	Size        int64  `json:"size"`
	PointerSize int64  `json:"pointerSize"`
}

// parseTree parses and checks one page of a tree listing: a JSON array of
// entries. Directories are returned unchecked; every file must have a valid
// path (see content.ValidatePath; no control characters either), a size that
// is not negative, and either an LFS sha256 (64 lowercase hex digits, a
// "sha256:" prefix allowed) with its size, or a git blob id (40 lowercase hex
// digits). A file's size is its LFS size, which the entry's size must equal
// (or, as some mirrors report, the pointer's size). Other entry types are
// errors. Errors wrap content.ErrInvalid.
func parseTree(data []byte) ([]treeEntry, error) {
	var entries []treeEntry
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&entries); err != nil {
		return nil, fmt.Errorf("%w: %v", content.ErrInvalid, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: data after the listing", content.ErrInvalid)
	}
	for i := range entries {
		e := &entries[i]
		switch e.Type {
		case "directory":
			continue
		case "file":
		default:
			return nil, fmt.Errorf("%w: entry %d: type %q (want file or directory)", content.ErrInvalid, i, fetch.Truncate(e.Type))
		}
		if err := content.ValidatePath(e.Path); err != nil {
			return nil, fmt.Errorf("entry %d: %w", i, err)
		}
		for j := 0; j < len(e.Path); j++ {
			if c := e.Path[j]; c < ' ' || c == 0x7f {
				return nil, fmt.Errorf("%w: entry %d: file path %q has a control character", content.ErrInvalid, i, fetch.Truncate(e.Path))
			}
		}
		if e.Size < 0 {
			return nil, fmt.Errorf("%w: file %q: negative size %d", content.ErrInvalid, fetch.Truncate(e.Path), e.Size)
		}
		if e.LFS != nil {
			e.LFS.OID = strings.TrimPrefix(e.LFS.OID, "sha256:")
			if !isHex(e.LFS.OID, 64) {
				return nil, fmt.Errorf("%w: file %q: LFS oid %q is not a sha256", content.ErrInvalid, fetch.Truncate(e.Path), fetch.Truncate(e.LFS.OID))
			}
			if e.LFS.Size < 0 || e.LFS.Size != e.Size && (e.LFS.PointerSize <= 0 || e.Size != e.LFS.PointerSize) {
				return nil, fmt.Errorf("%w: file %q: size %d, LFS size %d", content.ErrInvalid, fetch.Truncate(e.Path), e.Size, e.LFS.Size)
			}
			e.Size = e.LFS.Size
		} else if !isHex(e.OID, 40) {
			return nil, fmt.Errorf("%w: file %q: oid %q is not a git blob id", content.ErrInvalid, fetch.Truncate(e.Path), fetch.Truncate(e.OID))
		}
	}
	return entries, nil
}

// isHex reports whether s is n lowercase hex digits.
func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// nextLink returns the target of the rel="next" link among Link header
// values (RFC 8288), resolved against base, or nil when there is none.
func nextLink(values []string, base *url.URL) (*url.URL, error) {
	for _, v := range values {
		for v = strings.TrimSpace(v); v != ""; v = strings.TrimLeft(v, " \t,") {
			if v[0] != '<' {
				return nil, fmt.Errorf("%w: %q: want <URI>", content.ErrInvalid, fetch.Truncate(v))
			}
			end := strings.IndexByte(v, '>')
			if end < 0 {
				return nil, fmt.Errorf("%w: %q: unterminated <URI>", content.ErrInvalid, fetch.Truncate(v))
			}
			target := v[1:end]
			v = v[end+1:]
			next := false
			// Parameters run to the next ',' outside quotes.
			for len(v) > 0 && v[0] != ',' {
				v = strings.TrimLeft(v, " \t")
				if v == "" || v[0] == ',' {
					break
				}
				if v[0] != ';' {
					return nil, fmt.Errorf("%w: %q: want ';' before a parameter", content.ErrInvalid, fetch.Truncate(v))
				}
				v = strings.TrimLeft(v[1:], " \t")
				i := strings.IndexAny(v, "=;,")
				if i < 0 {
					i = len(v)
				}
				name := strings.ToLower(strings.TrimSpace(v[:i]))
				v = v[i:]
				var value string
				if strings.HasPrefix(v, "=") {
					v = strings.TrimLeft(v[1:], " \t")
					if strings.HasPrefix(v, `"`) {
						j := strings.IndexByte(v[1:], '"')
						if j < 0 {
							return nil, fmt.Errorf("%w: unterminated quoted parameter", content.ErrInvalid)
						}
						value, v = v[1:j+1], v[j+2:]
					} else {
						j := strings.IndexAny(v, ";,")
						if j < 0 {
							j = len(v)
						}
						value, v = strings.TrimSpace(v[:j]), v[j:]
					}
				}
				if name == "rel" && slices.Contains(strings.Fields(strings.ToLower(value)), "next") {
					next = true
				}
			}
			if next {
				ref, err := url.Parse(target)
				if err != nil {
					return nil, fmt.Errorf("%w: next page URL: %v", content.ErrInvalid, err)
				}
				u := base.ResolveReference(ref)
				if u.Scheme != "http" && u.Scheme != "https" {
					return nil, fmt.Errorf("%w: next page URL scheme %q", content.ErrInvalid, fetch.Truncate(u.Scheme))
				}
				u.Fragment, u.RawFragment = "", ""
				return u, nil
			}
		}
	}
	return nil, nil
}
