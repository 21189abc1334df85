package prefetch

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
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// DefaultHFEndpoint is the hub HFSource asks when no endpoint is given.
const DefaultHFEndpoint = "https://huggingface.co"

// Limits on what a hub may make HFSource hold or do.
const (
	// MaxHFInlineFile is the largest file not stored with LFS that HFSource
	// accepts: such files (configs, tokenizers) are read whole into memory
	// while resolving, to learn their sha256. The hub itself refuses larger
	// ones outside LFS.
	MaxHFInlineFile = 16 << 20
	// MaxHFInlineTotal bounds the bytes of all such files of one model.
	MaxHFInlineTotal = 256 << 20
	// maxHFListing bounds the bytes of all pages of a tree listing together.
	maxHFListing = 4 * MaxManifestSize
	// maxHFPages bounds the pages of a tree listing.
	maxHFPages = 10_000
	// hfInlineFetches is how many small files are read at once.
	hfInlineFetches = 8
	// hfAPITimeout bounds each metadata request and small-file read, body
	// included; a timeout is retried.
	hfAPITimeout = 2 * time.Minute
)

// HFSource resolves ref.KindHF references against a Hugging Face hub (or a
// mirror speaking its API) and reads their files.
//
// Resolving asks the hub which commit the revision names (unless the
// reference already gives a commit), then lists every file of the repository
// at that commit (GET /api/models/{repo}/tree/{commit}?recursive=true,
// following the Link header's pages). A file stored with LFS is known by the
// sha256 and size in the listing and read later with ranged GETs of
// /{repo}/resolve/{commit}/{path}, which the hub redirects to its CDN. A file
// stored in git (config.json, tokenizer files…) has only a git blob id there,
// so it is read whole while resolving (at most MaxHFInlineFile bytes each,
// MaxHFInlineTotal together), checked against that id, hashed, and served from
// memory.
//
// The model is named after the repository ("org/name") at the commit, so it
// materialises as models--org--name/snapshots/<commit>/, the hub cache layout.
// A reference to a branch or tag ("main", "v1.0") carries it as the model's
// Ref, so that refs/<branch> is written holding the commit, as the hub's
// own clients write it: offline, a loader finds the model by name and
// branch only through it. A reference pinned to a commit writes no ref.
//
// The token, if any, is sent only for the requesters WithHFAgentCredentials
// allows, as "Authorization: Bearer …" and only to the
// endpoint's own scheme, host and port: never to the CDN a download is
// redirected to, whatever the client's redirect policy.
type HFSource struct {
	endpoint *url.URL // no trailing slash
	base     string   // endpoint as a string, no trailing slash
	token    string
	version  string
	http     *HTTPSource // makes the requests; its client adds the token
	shared   SharedResolver
	// creds says which requesters the token is sent for; anon resolves
	// for the others (nil without a token).
	creds AgentCredentials
	anon  *HFSource
	// untrusted holds repo@commit listings another node gave wrongly.
	untrusted commitSet
}

// HFOption configures an HFSource.
type HFOption func(*HFSource) error

// WithHFEndpoint sets the hub's base URL (HF_ENDPOINT): an absolute http or
// https URL, possibly with a path prefix, without query, fragment or user
// information. The default is DefaultHFEndpoint.
func WithHFEndpoint(endpoint string) HFOption {
	return func(s *HFSource) error {
		u, err := url.Parse(strings.TrimRight(endpoint, "/"))
		switch {
		case err != nil:
			if ue, ok := err.(*url.Error); ok {
				err = ue.Err
			}
			return fmt.Errorf("%w: hub endpoint: %v", content.ErrInvalid, err)
		case u.Scheme != "http" && u.Scheme != "https":
			return fmt.Errorf("%w: hub endpoint %q: scheme must be http or https", content.ErrInvalid, truncate(endpoint))
		case u.Opaque != "" || u.Host == "" || u.Hostname() == "":
			return fmt.Errorf("%w: hub endpoint %q: want scheme://host[:port][/path]", content.ErrInvalid, truncate(endpoint))
		case u.User != nil:
			return fmt.Errorf("%w: hub endpoint %q: user information is not allowed (use a token)", content.ErrInvalid, truncate(endpoint))
		case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
			return fmt.Errorf("%w: hub endpoint %q: no query or fragment allowed", content.ErrInvalid, truncate(endpoint))
		case u.Port() != "" && !ref.ValidPort(u.Port()):
			return fmt.Errorf("%w: hub endpoint %q: port out of range", content.ErrInvalid, truncate(endpoint))
		}
		u.Host = strings.ToLower(u.Host)
		s.endpoint = u
		return nil
	}
}

// WithHFToken sets the access token (HF_TOKEN) sent to the hub as a bearer
// token; "" sends none. It must be printable ASCII without spaces.
func WithHFToken(token string) HFOption {
	return func(s *HFSource) error {
		for i := 0; i < len(token); i++ {
			if c := token[i]; c <= ' ' || c >= 0x7f {
				return fmt.Errorf("%w: hub token: byte %d is not printable ASCII", content.ErrInvalid, i)
			}
		}
		s.token = token
		return nil
	}
}

// WithHFAgentCredentials says for which requesters (see WithRequester) the
// token is sent: always for the operator, for a pod's namespace only where a
// rule names the hub's host (host[:port] of the endpoint) and the namespace.
// The default sends it for the operator alone. A pod's fetch without the
// token asks the hub as an anonymous client would, and takes no listing
// from peers, which may have resolved it with the token.
func WithHFAgentCredentials(a AgentCredentials) HFOption {
	return func(s *HFSource) error {
		s.creds = a
		return nil
	}
}

// WithHFShared resolves each listing at a commit through shared: once for
// the cluster, the other nodes taking the model from the node that asked the
// hub (see p2p.Swarm.SharedResolve). Without it every resolve asks the hub.
// A listing taken from another node is used only as the hub confirms it:
// its paths, sizes and LFS digests against the hub's listing, its other
// files' bytes against their git blob ids (see HFSource.confirm); what
// sharing saves is reading every small file on every node.
func WithHFShared(shared SharedResolver) HFOption {
	return func(s *HFSource) error {
		s.shared = shared
		return nil
	}
}

// WithHFVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithHFVersion(version string) HFOption {
	return func(s *HFSource) error {
		s.version = version
		return nil
	}
}

// NewHFSource returns a source for hub references that makes its requests
// with client (nil: a client with no overall timeout over
// http.DefaultTransport; stalled downloads are the cache's to detect). The
// client's redirect policy applies; the Range header survives redirects, the
// token never leaves the endpoint's host.
func NewHFSource(client *http.Client, opts ...HFOption) (*HFSource, error) {
	s := &HFSource{version: "dev"}
	if err := WithHFEndpoint(DefaultHFEndpoint)(s); err != nil {
		return nil, err
	}
	for _, o := range opts {
		if err := o(s); err != nil {
			return nil, err
		}
	}
	s.base = s.endpoint.String()
	if client == nil {
		client = &http.Client{Transport: http.DefaultTransport}
	}
	s.http = NewHTTPSource(client, WithVersion(s.version))
	if s.token != "" {
		s.anon = &HFSource{endpoint: s.endpoint, base: s.base, version: s.version, http: s.http}
		c := *client
		base := c.Transport
		if base == nil {
			base = http.DefaultTransport
		}
		c.Transport = &hfAuthTransport{base: base, origin: origin(s.endpoint), auth: "Bearer " + s.token}
		s.http = NewHTTPSource(&c, WithVersion(s.version))
	}
	return s, nil
}

// hfAuthTransport adds the Authorization header to requests for one origin
// only, so that no redirect can carry it elsewhere.
type hfAuthTransport struct {
	base   http.RoundTripper
	origin string
	auth   string
}

func (t *hfAuthTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if origin(req.URL) != t.origin || req.Header.Get("Authorization") != "" {
		return t.base.RoundTrip(req)
	}
	r := req.Clone(req.Context())
	r.Header.Set("Authorization", t.auth)
	return t.base.RoundTrip(r)
}

// CloseIdleConnections closes the idle connections of the transport below.
func (t *hfAuthTransport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// origin is "scheme://host:port" of u, lower-cased, with the default port
// made explicit.
func origin(u *url.URL) string {
	port := u.Port()
	if port == "" {
		switch u.Scheme {
		case "https":
			port = "443"
		case "http":
			port = "80"
		}
	}
	return strings.ToLower(u.Scheme + "://" + u.Hostname() + ":" + port)
}

// Resolve lists the repository's files at the commit the reference's
// revision names and returns the model with one opener per blob.
func (s *HFSource) Resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	if r.Kind != ref.KindHF || r.Repository == "" || r.Revision == "" {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	if ns := Requester(ctx); s.anon != nil && !s.creds.Allow(s.endpoint.Host, ns) {
		res, err := s.anon.Resolve(ctx, r)
		if err != nil {
			return nil, fmt.Errorf("%w (the agent's hub token is not used for namespace %q)", err, ns)
		}
		return res, nil
	}
	res, err := s.resolve(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	// Set here, not in the listing shared with peers: the ref is this
	// reference's, the listing at the commit any reference's (and a peer's
	// listing names no ref of ours).
	res.Model.Ref = ""
	if !content.IsCommit(r.Revision) {
		if err := content.ValidateRef(r.Revision); err != nil {
			return nil, content.Permanent(fmt.Errorf("resolving %s: %w", r.Redacted(), err))
		}
		res.Model.Ref = r.Revision
	}
	return res, nil
}

func (s *HFSource) resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	commit := r.Revision
	if !content.IsCommit(commit) {
		var err error
		if commit, err = s.commit(ctx, r.Repository, r.Revision); err != nil {
			return nil, err
		}
	}
	if s.shared == nil || s.distrusted(r.Repository, commit) {
		return s.resolveAt(ctx, r.Repository, commit)
	}
	// The listing at a commit never changes: resolve it once for the
	// cluster, taking another node's answer only as the hub confirms it.
	var (
		own     *Resolution
		confirm hubConfirmation
	)
	m, err := s.shared(ctx, ref.Ref{Kind: ref.KindHF, Repository: r.Repository, Revision: commit}, func(ctx context.Context) (content.Model, error) {
		res, err := confirm.resolve(ctx, s, r.Repository, commit)
		if err != nil {
			return content.Model{}, err
		}
		own = res
		return res.Model, nil
	}, func(m content.Model) error { return confirm.check(ctx, s, r.Repository, commit, m) })
	switch {
	case err != nil:
		return nil, err
	case own != nil:
		return own, nil
	}
	return confirm.resolution(s, m), nil
}

// resolveAt lists the repository's files at a commit, reads the small ones
// and returns the model with an opener per blob.
func (s *HFSource) resolveAt(ctx context.Context, repo, commit string) (*Resolution, error) {
	entries, err := s.list(ctx, repo, commit)
	if err != nil {
		return nil, err
	}
	return s.resolveListing(ctx, repo, commit, entries)
}

// resolveListing is resolveAt once the listing is read.
func (s *HFSource) resolveListing(ctx context.Context, repo, commit string, entries []hfTreeEntry) (*Resolution, error) {
	if len(entries) == 0 {
		return nil, content.Permanent(fmt.Errorf("%w: repository has no files at commit %s", content.ErrNotFound, commit))
	}
	if err := checkHFPaths(entries); err != nil {
		return nil, content.Permanent(fmt.Errorf("hub listing at %s: %w", commit, err))
	}
	res := &Resolution{
		Model: content.Model{Name: repo, Revision: commit, Files: make([]content.File, len(entries))},
		Blobs: make(map[digest.Digest]content.RangeOpener),
	}
	var inline []int
	var inlineTotal int64
	for i, e := range entries {
		res.Model.Files[i].Path = e.Path
		if e.LFS == nil {
			if e.Size > MaxHFInlineFile {
				return nil, content.Permanent(fmt.Errorf("%w: file %q of %d bytes is not stored with LFS and larger than %d", content.ErrInvalid, e.Path, e.Size, MaxHFInlineFile))
			}
			if inlineTotal += e.Size; inlineTotal > MaxHFInlineTotal {
				return nil, content.Permanent(fmt.Errorf("%w: files not stored with LFS add up to more than %d bytes", content.ErrInvalid, MaxHFInlineTotal))
			}
			inline = append(inline, i)
			continue
		}
		d := content.Descriptor{Digest: digest.NewDigestFromEncoded(digest.SHA256, e.LFS.OID), Size: e.Size}
		res.Model.Files[i].Descriptor = d
		if _, ok := res.Blobs[d.Digest]; !ok {
			res.Blobs[d.Digest] = s.blob(s.fileURL(repo, commit, e.Path), e.Size)
		}
	}

	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(hfInlineFetches)
	var mu sync.Mutex
	for _, i := range inline {
		g.Go(func() error {
			e := entries[i]
			data, err := s.fetchSmall(gctx, s.fileURL(repo, commit, e.Path), commit, e)
			if err != nil {
				return fmt.Errorf("file %q: %w", e.Path, err)
			}
			d := content.Descriptor{Digest: digest.FromBytes(data), Size: e.Size}
			mu.Lock()
			defer mu.Unlock()
			res.Model.Files[i].Descriptor = d
			if _, ok := res.Blobs[d.Digest]; !ok {
				res.Blobs[d.Digest] = cache.Bytes(data)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	if err := res.Model.Validate(); err != nil {
		return nil, content.Permanent(fmt.Errorf("hub listing at %s: %w", commit, err))
	}
	return res, nil
}

// checkHFPaths checks, before anything is fetched, that no two files have
// the same path and no file is also another's directory.
func checkHFPaths(entries []hfTreeEntry) error {
	files := make(map[string]bool, len(entries))
	for _, e := range entries {
		if files[e.Path] {
			return fmt.Errorf("%w: duplicate file %q", content.ErrInvalid, truncate(e.Path))
		}
		files[e.Path] = true
	}
	for _, e := range entries {
		for dir := path.Dir(e.Path); dir != "."; dir = path.Dir(dir) {
			if files[dir] {
				return fmt.Errorf("%w: %q is both a file and a directory", content.ErrInvalid, truncate(dir))
			}
		}
	}
	return nil
}

// commit asks the hub which commit revision names.
func (s *HFSource) commit(ctx context.Context, repo, revision string) (string, error) {
	u, err := url.Parse(s.base + "/api/models/" + repo + "/revision/" + url.PathEscape(revision) + "?expand=sha")
	if err != nil {
		return "", content.Permanent(fmt.Errorf("%w: %v", content.ErrInvalid, err))
	}
	ctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
	defer cancel()
	body, _, err := s.getJSON(ctx, u, MaxManifestSize)
	if err != nil {
		return "", err
	}
	var info struct {
		SHA string `json:"sha"`
	}
	if err := json.Unmarshal(body, &info); err != nil {
		return "", content.Permanent(fmt.Errorf("%w: GET %s: model info: %v", content.ErrInvalid, redact(u), err))
	}
	if !content.IsCommit(info.SHA) {
		return "", content.Permanent(fmt.Errorf("%w: GET %s: model info names commit %q, want 40 lowercase hex digits", content.ErrInvalid, redact(u), truncate(info.SHA)))
	}
	return info.SHA, nil
}

// list returns the files of the repository at commit, sorted by path,
// following the listing's pages.
func (s *HFSource) list(ctx context.Context, repo, commit string) ([]hfTreeEntry, error) {
	u, err := url.Parse(s.base + "/api/models/" + repo + "/tree/" + commit + "?recursive=true")
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%w: %v", content.ErrInvalid, err))
	}
	var (
		files []hfTreeEntry
		total int64
		read  int64
		seen  = map[string]bool{u.String(): true}
	)
	for page := 0; u != nil; page++ {
		if page == maxHFPages {
			return nil, content.Permanent(fmt.Errorf("%w: tree listing has more than %d pages", content.ErrInvalid, maxHFPages))
		}
		pctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
		body, header, err := s.getJSON(pctx, u, maxHFListing-read)
		cancel()
		if err != nil {
			return nil, err
		}
		read += int64(len(body))
		entries, err := parseHFTree(body)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("GET %s: tree listing: %w", redact(u), err))
		}
		for _, e := range entries {
			if e.Type != "file" {
				continue
			}
			if len(files) == MaxManifestFiles {
				return nil, content.Permanent(fmt.Errorf("%w: repository has more than %d files", content.ErrInvalid, MaxManifestFiles))
			}
			if e.Size > math.MaxInt64-total {
				return nil, content.Permanent(fmt.Errorf("%w: file sizes add up past %d bytes", content.ErrInvalid, int64(math.MaxInt64)))
			}
			total += e.Size
			files = append(files, e)
		}
		next, err := nextLink(header.Values("Link"), u)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("GET %s: Link header: %w", redact(u), err))
		}
		if next != nil {
			if origin(next) != origin(s.endpoint) {
				return nil, content.Permanent(fmt.Errorf("%w: GET %s: next page %s is not on the hub %s", content.ErrInvalid, redact(u), redact(next), s.base))
			}
			if seen[next.String()] {
				return nil, content.Permanent(fmt.Errorf("%w: GET %s: the listing's pages loop", content.ErrInvalid, redact(u)))
			}
			seen[next.String()] = true
		}
		u = next
	}
	slices.SortFunc(files, func(a, b hfTreeEntry) int { return strings.Compare(a.Path, b.Path) })
	return files, nil
}

// getJSON GETs u and returns its body of at most limit bytes.
func (s *HFSource) getJSON(ctx context.Context, u *url.URL, limit int64) ([]byte, http.Header, error) {
	resp, err := s.http.do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept", "application/json") })
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, nil, s.statusError(resp, u)
	}
	if resp.ContentLength > limit {
		return nil, nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes, more than the %d allowed", content.ErrInvalid, redact(u), resp.ContentLength, limit))
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, nil, fmt.Errorf("GET %s: %w", redact(u), err)
	}
	if int64(len(body)) > limit {
		return nil, nil, content.Permanent(fmt.Errorf("%w: GET %s: more than the %d bytes allowed", content.ErrInvalid, redact(u), limit))
	}
	return body, resp.Header, nil
}

// fetchSmall reads a file not stored with LFS whole and checks it against
// its size and git blob id.
func (s *HFSource) fetchSmall(ctx context.Context, u *url.URL, commit string, e hfTreeEntry) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, hfAPITimeout)
	defer cancel()
	resp, err := s.http.do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept-Encoding", "identity") })
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, s.statusError(resp, u)
	}
	if c := resp.Header.Get("X-Repo-Commit"); c != "" && c != commit {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: hub answered for commit %q", content.ErrInvalid, redact(u), truncate(c)))
	}
	if resp.ContentLength >= 0 && resp.ContentLength != e.Size {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes, the listing says %d", content.ErrSizeMismatch, redact(u), resp.ContentLength, e.Size))
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, e.Size+1))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", redact(u), err)
	}
	if int64(len(data)) != e.Size {
		return nil, content.Permanent(fmt.Errorf("%w: GET %s: %d bytes or more, the listing says %d", content.ErrSizeMismatch, redact(u), len(data), e.Size))
	}
	if got := gitBlobID(data); got != e.OID {
		// Bytes damaged on the way, or a hub that lies: worth another try.
		return nil, fmt.Errorf("%w: GET %s: git blob id %s, the listing says %s", content.ErrDigestMismatch, redact(u), got, e.OID)
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
func (s *HFSource) fileURL(repo, commit, file string) *url.URL {
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
func (s *HFSource) statusError(resp *http.Response, u *url.URL) error {
	code := resp.Header.Get("X-Error-Code")
	msg := resp.Header.Get("X-Error-Message")
	err := statusError(resp, u)
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
		sb.WriteString(" (hub error " + strconv.Quote(truncate(code)))
		if msg != "" {
			sb.WriteString(": " + strconv.Quote(truncate(msg)))
		}
		sb.WriteString(")")
	} else if msg != "" {
		sb.WriteString(" (hub says " + strconv.Quote(truncate(msg)) + ")")
	}
	if hint != "" {
		sb.WriteString(": " + hint)
	}
	if sb.Len() == 0 {
		return err
	}
	return fmt.Errorf("%w%s", err, sb.String())
}

// hfTreeEntry is one entry of a tree listing: a file or a directory.
type hfTreeEntry struct {
	Type string     `json:"type"`
	OID  string     `json:"oid"`
	Size int64      `json:"size"`
	Path string     `json:"path"`
	LFS  *hfTreeLFS `json:"lfs"`
}

type hfTreeLFS struct {
	OID         string `json:"oid"` // sha256, hex
	Size        int64  `json:"size"`
	PointerSize int64  `json:"pointerSize"`
}

// parseHFTree parses and checks one page of a tree listing: a JSON array of
// entries. Directories are returned unchecked; every file must have a valid
// path (see content.ValidatePath; no control characters either), a size that
// is not negative, and either an LFS sha256 (64 lowercase hex digits, a
// "sha256:" prefix allowed) with its size, or a git blob id (40 lowercase hex
// digits). A file's size is its LFS size, which the entry's size must equal
// (or, as some mirrors report, the pointer's size). Other entry types are
// errors. Errors wrap content.ErrInvalid.
func parseHFTree(data []byte) ([]hfTreeEntry, error) {
	var entries []hfTreeEntry
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
			return nil, fmt.Errorf("%w: entry %d: type %q (want file or directory)", content.ErrInvalid, i, truncate(e.Type))
		}
		if err := content.ValidatePath(e.Path); err != nil {
			return nil, fmt.Errorf("entry %d: %w", i, err)
		}
		for j := 0; j < len(e.Path); j++ {
			if c := e.Path[j]; c < ' ' || c == 0x7f {
				return nil, fmt.Errorf("%w: entry %d: file path %q has a control character", content.ErrInvalid, i, truncate(e.Path))
			}
		}
		if e.Size < 0 {
			return nil, fmt.Errorf("%w: file %q: negative size %d", content.ErrInvalid, truncate(e.Path), e.Size)
		}
		if e.LFS != nil {
			e.LFS.OID = strings.TrimPrefix(e.LFS.OID, "sha256:")
			if !isHex(e.LFS.OID, 64) {
				return nil, fmt.Errorf("%w: file %q: LFS oid %q is not a sha256", content.ErrInvalid, truncate(e.Path), truncate(e.LFS.OID))
			}
			if e.LFS.Size < 0 || e.LFS.Size != e.Size && (e.LFS.PointerSize <= 0 || e.Size != e.LFS.PointerSize) {
				return nil, fmt.Errorf("%w: file %q: size %d, LFS size %d", content.ErrInvalid, truncate(e.Path), e.Size, e.LFS.Size)
			}
			e.Size = e.LFS.Size
		} else if !isHex(e.OID, 40) {
			return nil, fmt.Errorf("%w: file %q: oid %q is not a git blob id", content.ErrInvalid, truncate(e.Path), truncate(e.OID))
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
				return nil, fmt.Errorf("%w: %q: want <URI>", content.ErrInvalid, truncate(v))
			}
			end := strings.IndexByte(v, '>')
			if end < 0 {
				return nil, fmt.Errorf("%w: %q: unterminated <URI>", content.ErrInvalid, truncate(v))
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
					return nil, fmt.Errorf("%w: %q: want ';' before a parameter", content.ErrInvalid, truncate(v))
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
					return nil, fmt.Errorf("%w: next page URL scheme %q", content.ErrInvalid, truncate(u.Scheme))
				}
				u.Fragment, u.RawFragment = "", ""
				return u, nil
			}
		}
	}
	return nil, nil
}

// blob reads a file with ranged GETs of its resolve URL at a commit, which
// the hub redirects to its CDN. A 206 must carry
// "Content-Range: bytes off-(end-1)/size"; a 200 is accepted only from
// offset 0 (a server that ignores Range cannot resume) and must have the
// expected Content-Length when it has one. The hub's errors name its
// X-Error-Code; 401, 403 and 404 are permanent, 429 and 5xx are not.
func (s *HFSource) blob(u *url.URL, size int64) rangedBlob {
	return rangedBlob{size: size, fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		resp, err := s.http.do(ctx, http.MethodGet, u, rangeHeader(off, end, size, false))
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 400 && resp.StatusCode != http.StatusRequestedRangeNotSatisfiable {
			return nil, s.statusError(resp, u)
		}
		if resp.StatusCode == http.StatusOK && off > 0 {
			drainClose(resp.Body)
			return nil, content.Permanent(fmt.Errorf("GET %s: the server ignored Range (HTTP 200 for bytes %d-): cannot resume", redact(u), off))
		}
		if err := checkRange(resp, off, end, size); err != nil {
			if errors.Is(err, errUnexpectedStatus) {
				err = statusError(resp, u)
			}
			drainClose(resp.Body)
			return nil, fmt.Errorf("GET %s: %w", redact(u), err)
		}
		return resp.Body, nil
	}}
}
