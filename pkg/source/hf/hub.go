package hf

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/weightd/weightd/pkg/content"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// commit asks the hub which commit revision names.
func (s *Source) commit(ctx context.Context, repo, revision string) (string, error) {
	u, err := url.Parse(s.base + "/api/models/" + repo + "/revision/" + url.PathEscape(revision) + "?expand=sha")
	if err != nil {
		return "", content.Permanent(fmt.Errorf("%w: %v", content.ErrInvalid, err))
	}
	ctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
	defer cancel()
	body, _, err := s.getJSON(ctx, u, httpsource.MaxManifestSize)
	if err != nil {
		return "", err
	}
	var info struct {
		SHA string `json:"sha"`
	}
	if err := json.Unmarshal(body, &info); err != nil {
		return "", content.Permanent(fmt.Errorf("%w: GET %s: model info: %v", content.ErrInvalid, fetch.Redact(u), err))
	}
	if !content.IsCommit(info.SHA) {
		return "", content.Permanent(fmt.Errorf("%w: GET %s: model info names commit %q, want 40 lowercase hex digits", content.ErrInvalid, fetch.Redact(u), fetch.Truncate(info.SHA)))
	}
	return info.SHA, nil
}

// list returns the files of the repository at commit, sorted by path,
// following the listing's pages.
func (s *Source) list(ctx context.Context, repo, commit string) ([]treeEntry, error) {
	u, err := url.Parse(s.base + "/api/models/" + repo + "/tree/" + commit + "?recursive=true")
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%w: %v", content.ErrInvalid, err))
	}
	var (
		files []treeEntry
		total int64
		read  int64
		seen  = map[string]bool{u.String(): true}
	)
	for page := 0; u != nil; page++ {
		if page == maxPages {
			return nil, content.Permanent(fmt.Errorf("%w: tree listing has more than %d pages", content.ErrInvalid, maxPages))
		}
		pctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
		body, header, err := s.getJSON(pctx, u, maxListing-read)
		cancel()
		if err != nil {
			return nil, err
		}
		read += int64(len(body))
		entries, err := parseTree(body)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("GET %s: tree listing: %w", fetch.Redact(u), err))
		}
		for _, e := range entries {
			if e.Type != "file" {
				continue
			}
			if len(files) == httpsource.MaxManifestFiles {
				return nil, content.Permanent(fmt.Errorf("%w: repository has more than %d files", content.ErrInvalid, httpsource.MaxManifestFiles))
			}
			if e.Size > math.MaxInt64-total {
				return nil, content.Permanent(fmt.Errorf("%w: file sizes add up past %d bytes", content.ErrInvalid, int64(math.MaxInt64)))
			}
			total += e.Size
			files = append(files, e)
		}
		next, err := nextLink(header.Values("Link"), u)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("GET %s: Link header: %w", fetch.Redact(u), err))
		}
		if next != nil {
			if origin(next) != origin(s.endpoint) {
				return nil, content.Permanent(fmt.Errorf("%w: GET %s: next page %s is not on the hub %s", content.ErrInvalid, fetch.Redact(u), fetch.Redact(next), s.base))
			}
			if seen[next.String()] {
				return nil, content.Permanent(fmt.Errorf("%w: GET %s: the listing's pages loop", content.ErrInvalid, fetch.Redact(u)))
			}
			seen[next.String()] = true
		}
		u = next
	}
	slices.SortFunc(files, func(a, b treeEntry) int { return strings.Compare(a.Path, b.Path) })
	return files, nil
}

// getJSON GETs u and returns its body of at most limit bytes.
func (s *Source) getJSON(ctx context.Context, u *url.URL, limit int64) ([]byte, http.Header, error) {
	resp, err := s.http.Do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept", "application/json") })
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, nil, s.statusError(resp, u)
	}
	if resp.ContentLength > limit {
		return nil, nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes, more than the %d allowed", content.ErrInvalid, fetch.Redact(u), resp.ContentLength, limit))
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, nil, fmt.Errorf("GET %s: %w", fetch.Redact(u), err)
	}
	if int64(len(body)) > limit {
		return nil, nil, content.Permanent(fmt.Errorf("%w: GET %s: more than the %d bytes allowed", content.ErrInvalid, fetch.Redact(u), limit))
	}
	return body, resp.Header, nil
}

// fetchSmall reads a file not stored with LFS whole and checks it against
// its size and git blob id.
func (s *Source) fetchSmall(ctx context.Context, u *url.URL, commit string, e treeEntry) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
	defer cancel()
	resp, err := s.http.Do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept-Encoding", "identity") })
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, s.statusError(resp, u)
	}
	if c := resp.Header.Get("X-Repo-Commit"); c != "" && c != commit {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: hub answered for commit %q", content.ErrInvalid, fetch.Redact(u), fetch.Truncate(c)))
	}
	if resp.ContentLength >= 0 && resp.ContentLength != e.Size {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes, the listing says %d", content.ErrSizeMismatch, fetch.Redact(u), resp.ContentLength, e.Size))
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, e.Size+1))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", fetch.Redact(u), err)
	}
	if int64(len(data)) != e.Size {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes or more, the listing says %d", content.ErrSizeMismatch, fetch.Redact(u), len(data), e.Size))
	}
	if got := gitBlobID(data); got != e.OID {
		// Bytes damaged on the way, or a hub that lies: worth another try.
		return nil, fmt.Errorf("%w: GET %s: git blob id %s, the listing says %s", content.ErrDigestMismatch, fetch.Redact(u), got, e.OID)
	}
	return data, nil
}

// gitBlobID is git's object id of a blob holding data.
func gitBlobID(data []byte) string {
	id, _ := readGitBlobID(bytes.NewReader(data), int64(len(data))) // reading bytes never fails
	return id
}

// readGitBlobID is git's object id of a blob of size bytes read from r.
func readGitBlobID(r io.Reader, size int64) (string, error) {
	h := sha1.New()
	h.Write([]byte("blob " + strconv.FormatInt(size, 10) + "\x00"))
	n, err := io.Copy(h, r)
	if err != nil {
		return "", err
	}
	if n != size {
		return "", fmt.Errorf("%w: %d bytes, want %d", content.ErrSizeMismatch, n, size)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// fileURL is /{repo}/resolve/{commit}/{path} on the hub, each path segment
// escaped.
func (s *Source) fileURL(repo, commit, file string) *url.URL {
	segs := strings.Split(file, "/")
	for i, seg := range segs {
		segs[i] = url.PathEscape(seg)
	}
	u, err := url.Parse(s.base + "/" + repo + "/resolve/" + commit + "/" + strings.Join(segs, "/"))
	if err != nil {
		panic(err) // the base parsed, and every segment is escaped
	}
	return u
}

// statusError is statusError with what the hub says in X-Error-Code and
// X-Error-Message, and a hint for the errors people can fix.
func (s *Source) statusError(resp *http.Response, u *url.URL) error {
	code := resp.Header.Get("X-Error-Code")
	msg := resp.Header.Get("X-Error-Message")
	err := fetch.ResponseError(resp, u)
	var hint string
	switch {
	case code == "GatedRepo" && s.token == "":
		hint = "the repository is gated: accept its conditions on the hub and give a token (HF_TOKEN) of an account that was granted access"
	case code == "GatedRepo":
		hint = "the repository is gated and the token (HF_TOKEN) given is not of an account that was granted access"
	case (code == "RepoNotFound" || code == "" && resp.StatusCode == http.StatusUnauthorized) && s.token == "":
		hint = "no such repository, or it is private: check the name, and give a token (HF_TOKEN) that can read it"
	case code == "RepoNotFound" || code == "" && resp.StatusCode == http.StatusUnauthorized:
		hint = "no such repository, or the token (HF_TOKEN) given is invalid or cannot read it"
	case code == "RevisionNotFound":
		hint = "no such branch, tag or commit in the repository"
	case code == "EntryNotFound":
		hint = "no such file at that commit"
	case resp.StatusCode == http.StatusForbidden:
		hint = "access refused: the token (HF_TOKEN) may lack the read permission"
	}
	var sb strings.Builder
	if code != "" {
		sb.WriteString(" (hub error " + strconv.Quote(fetch.Truncate(code)))
		if msg != "" {
			sb.WriteString(": " + strconv.Quote(fetch.Truncate(msg)))
		}
		sb.WriteString(")")
	} else if msg != "" {
		sb.WriteString(" (hub says " + strconv.Quote(fetch.Truncate(msg)) + ")")
	}
	if hint != "" {
		sb.WriteString(": " + hint)
	}
	if sb.Len() == 0 {
		return err
	}
	return fmt.Errorf("%w%s", err, sb.String())
}

// blob reads a file with ranged GETs of its resolve URL at a commit, which
// the hub redirects to its CDN. A 206 must carry
// "Content-Range: bytes off-(end-1)/size"; a 200 is accepted only from
// offset 0 (a server that ignores Range cannot resume) and must have the
// expected Content-Length when it has one. The hub's errors name its
// X-Error-Code; 401, 403 and 404 are permanent, 429 and 5xx are not.
func (s *Source) blob(u *url.URL, size int64) fetch.Blob {
	return fetch.Blob{Size: size, Fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		resp, err := s.http.Do(ctx, http.MethodGet, u, fetch.RangeHeader(off, end, size, false))
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 400 && resp.StatusCode != http.StatusRequestedRangeNotSatisfiable {
			return nil, s.statusError(resp, u)
		}
		if resp.StatusCode == http.StatusOK && off > 0 {
			fetch.DrainClose(resp.Body)
			return nil, content.Permanent(fmt.Errorf("GET %s: the server ignored Range (HTTP 200 for bytes %d-): cannot resume", fetch.Redact(u), off))
		}
		if err := fetch.CheckRange(resp, off, end, size); err != nil {
			if errors.Is(err, fetch.ErrUnexpectedStatus) {
				err = fetch.ResponseError(resp, u)
			}
			fetch.DrainClose(resp.Body)
			return nil, fmt.Errorf("GET %s: %w", fetch.Redact(u), err)
		}
		return resp.Body, nil
	}}
}
