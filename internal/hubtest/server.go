package hubtest

import (
	"crypto/hmac"
	"crypto/sha1"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// cdnLifetime is how long a signed CDN URL is valid.
const cdnLifetime = time.Hour

// serveHub routes a request to the hub's server.
func (h *Hub) serveHub(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		hubError(w, http.StatusMethodNotAllowed, "", "Method not allowed")
		return
	}
	segs, ok := splitEscaped(r.URL.EscapedPath())
	if !ok {
		hubError(w, http.StatusBadRequest, "", "Bad path")
		return
	}
	switch {
	case len(segs) >= 2 && segs[0] == "api" && segs[1] == "models":
		h.serveAPI(w, r, segs[2:])
	case len(segs) >= 1 && segs[0] == "cdn" && h.cdn == nil:
		h.serveCDN(w, r, segs[1:])
	default:
		h.serveResolve(w, r, segs)
	}
}

// serveCDNHost serves the separate CDN server.
func (h *Hub) serveCDNHost(w http.ResponseWriter, r *http.Request) {
	segs, ok := splitEscaped(r.URL.EscapedPath())
	if !ok || len(segs) == 0 || segs[0] != "cdn" || (r.Method != http.MethodGet && r.Method != http.MethodHead) {
		cdnError(w, http.StatusNotFound, "NoSuchKey", "The specified key does not exist.")
		return
	}
	h.serveCDN(w, r, segs[1:])
}

// splitEscaped splits an escaped path into its unescaped segments, so that an
// escaped '/' ("%2F") stays inside its segment.
func splitEscaped(p string) ([]string, bool) {
	p = strings.TrimPrefix(p, "/")
	if p == "" {
		return nil, true
	}
	segs := strings.Split(p, "/")
	for i, s := range segs {
		u, err := url.PathUnescape(s)
		if err != nil {
			return nil, false
		}
		segs[i] = u
	}
	return segs, true
}

// splitRepo finds the repository id at the start of segs, followed by one of
// the actions: "org/name" is tried before "name". It prefers an id that
// names a repository; ok is false when no split fits.
func (h *Hub) splitRepo(segs []string, actions ...string) (id string, rest []string, ok bool) {
	for _, k := range []int{2, 1} {
		if len(segs) < k {
			continue
		}
		r := segs[k:]
		if len(actions) > 0 && (len(r) == 0 || !slices.Contains(actions, r[0])) && (len(r) != 0 || !slices.Contains(actions, "")) {
			continue
		}
		cand := strings.Join(segs[:k], "/")
		h.mu.Lock()
		_, exists := h.repos[cand]
		h.mu.Unlock()
		if exists {
			return cand, r, true
		}
		if !ok {
			id, rest, ok = cand, r, true
		}
	}
	return id, rest, ok
}

// lookup finds the repository and checks the request may see it.
func (h *Hub) lookup(w http.ResponseWriter, r *http.Request, id string) *Repo {
	h.mu.Lock()
	repo := h.repos[id]
	h.mu.Unlock()
	if repo == nil {
		hubError(w, http.StatusNotFound, "RepoNotFound", "Repository not found")
		return nil
	}
	if repo.private {
		switch tok := bearer(r); {
		case tok == "":
			hubError(w, http.StatusUnauthorized, "RepoNotFound", "Repository not found")
			return nil
		case tok != repo.token:
			hubError(w, http.StatusUnauthorized, "RepoNotFound", "Invalid credentials in Authorization header")
			return nil
		}
	}
	return repo
}

// revisionAt splits segs into a revision and a path: the revision is the
// shortest prefix of segments, joined by '/', that names a commit (an escaped
// revision is one segment). It returns the commit, or nil and the first
// segment as the revision named.
func (repo *Repo) revisionAt(segs []string) (c *commit, rev string, rest []string) {
	repo.hub.mu.Lock()
	defer repo.hub.mu.Unlock()
	for i := 1; i <= len(segs); i++ {
		rev := strings.Join(segs[:i], "/")
		if c := repo.commitLocked(rev); c != nil {
			return c, rev, segs[i:]
		}
	}
	if len(segs) == 0 {
		return nil, "", nil
	}
	return nil, segs[0], nil
}

func (h *Hub) fault(w http.ResponseWriter, route Route) bool {
	h.count(route)
	status := h.takeFault(route)
	if status == 0 {
		return false
	}
	if status == http.StatusTooManyRequests {
		w.Header().Set("Retry-After", "1")
		hubError(w, status, "", "You have been rate-limited; retry later.")
		return true
	}
	if route == RouteCDN {
		cdnError(w, status, "InternalError", "Injected fault.")
		return true
	}
	hubError(w, status, "", "Injected fault: "+http.StatusText(status))
	return true
}

// serveAPI serves /api/models/{repo_id}[/revision/{rev}] and
// /api/models/{repo_id}/tree/{rev}[/{path}].
func (h *Hub) serveAPI(w http.ResponseWriter, r *http.Request, segs []string) {
	id, rest, ok := h.splitRepo(segs, "", "revision", "tree")
	if !ok {
		hubError(w, http.StatusNotFound, "", "Not found")
		return
	}
	route := RouteInfo
	if len(rest) > 0 && rest[0] == "tree" {
		route = RouteTree
	}
	if h.fault(w, route) {
		return
	}
	repo := h.lookup(w, r, id)
	if repo == nil {
		return
	}
	if route == RouteTree {
		h.serveTree(w, r, repo, rest[1:])
		return
	}
	var c *commit
	rev := "main"
	if len(rest) > 0 {
		if len(rest) == 1 {
			hubError(w, http.StatusNotFound, "", "Not found")
			return
		}
		rev = strings.Join(rest[1:], "/")
	}
	repo.hub.mu.Lock()
	c = repo.commitLocked(rev)
	repo.hub.mu.Unlock()
	if c == nil {
		hubError(w, http.StatusNotFound, "RevisionNotFound", "Invalid rev id: "+rev)
		return
	}
	info, bad := repo.info(c, r.URL.Query())
	if bad != "" {
		hubError(w, http.StatusBadRequest, "", fmt.Sprintf("Invalid expand property: %q", bad))
		return
	}
	writeJSON(w, info)
}

type sibling struct {
	RFilename string   `json:"rfilename"`
	BlobID    string   `json:"blobId,omitempty"`
	Size      *int64   `json:"size,omitempty"`
	LFS       *lfsInfo `json:"lfs,omitempty"`
}

type lfsInfo struct {
	SHA256      string `json:"sha256"`
	Size        int64  `json:"size"`
	PointerSize int    `json:"pointerSize"`
}

// info is the model info of repo at commit c: all properties, or with
// ?expand= only "_id", "id" and those named; bad is an unknown property
// asked for.
func (repo *Repo) info(c *commit, q url.Values) (info map[string]any, bad string) {
	blobs := q.Get("blobs") == "true"
	siblings := make([]sibling, 0, len(c.paths))
	for _, p := range c.paths {
		s := sibling{RFilename: p}
		if blobs {
			f := c.files[p]
			s.BlobID, s.Size = f.gitOID, &f.size
			if f.lfs {
				s.LFS = &lfsInfo{SHA256: f.sha256, Size: f.size, PointerSize: f.pointer}
			}
		}
		siblings = append(siblings, s)
	}
	var gated any = false
	if repo.gated {
		gated = "manual"
	}
	author, _, _ := strings.Cut(repo.id, "/")
	if !strings.Contains(repo.id, "/") {
		author = ""
	}
	sum := sha1.Sum([]byte(repo.id))
	all := map[string]any{
		"_id":          hex.EncodeToString(sum[:12]),
		"id":           repo.id,
		"author":       author,
		"sha":          c.sha,
		"lastModified": c.time.Format("2006-01-02T15:04:05.000Z"),
		"createdAt":    repo.created.Format("2006-01-02T15:04:05.000Z"),
		"private":      repo.private,
		"gated":        gated,
		"disabled":     false,
		"downloads":    0,
		"likes":        0,
		"tags":         []string{},
		"library_name": "transformers",
		"siblings":     siblings,
		"spaces":       []string{},
	}
	expand := append(q["expand"], q["expand[]"]...)
	if len(expand) == 0 {
		return all, ""
	}
	out := map[string]any{"_id": all["_id"], "id": all["id"]}
	for _, e := range expand {
		v, ok := all[e]
		if !ok {
			return nil, e
		}
		out[e] = v
	}
	return out, ""
}

// treeEntry is one entry of a tree listing, in the hub's shape.
type treeEntry struct {
	Type               string         `json:"type"`
	OID                string         `json:"oid"`
	Size               int64          `json:"size"`
	Path               string         `json:"path"`
	LFS                *treeLFS       `json:"lfs,omitempty"`
	LastCommit         *lastCommit    `json:"lastCommit,omitempty"`
	SecurityFileStatus map[string]any `json:"securityFileStatus,omitempty"`
}

type treeLFS struct {
	OID         string `json:"oid"`
	Size        int64  `json:"size"`
	PointerSize int    `json:"pointerSize"`
}

type lastCommit struct {
	ID    string `json:"id"`
	Title string `json:"title"`
	Date  string `json:"date"`
}

// serveTree serves tree/{rev}[/{path}], a page at a time.
func (h *Hub) serveTree(w http.ResponseWriter, r *http.Request, repo *Repo, segs []string) {
	c, rev, rest := repo.revisionAt(segs)
	if c == nil {
		hubError(w, http.StatusNotFound, "RevisionNotFound", "Invalid rev id: "+rev)
		return
	}
	dir := strings.Join(rest, "/")
	if dir != "" {
		if _, ok := c.dirs[dir]; !ok {
			hubError(w, http.StatusNotFound, "EntryNotFound", fmt.Sprintf("%s does not exist on %q", dir, rev))
			return
		}
	}
	q := r.URL.Query()
	recursive := q.Get("recursive") == "true" || q.Get("recursive") == "True" || q.Get("recursive") == "1"
	expand := q.Get("expand") == "true" || q.Get("expand") == "True" || q.Get("expand") == "1"
	off := 0
	if cur := q.Get("cursor"); cur != "" {
		b, err := base64.RawURLEncoding.DecodeString(cur)
		n, err2 := strconv.Atoi(string(b))
		if err != nil || err2 != nil || n < 0 {
			hubError(w, http.StatusBadRequest, "", "Invalid cursor")
			return
		}
		off = n
	}

	under := func(p string) bool {
		if dir != "" {
			if !strings.HasPrefix(p, dir+"/") {
				return false
			}
			p = p[len(dir)+1:]
		}
		return recursive || !strings.Contains(p, "/")
	}
	var entries []treeEntry
	for d, oid := range c.dirs {
		if under(d) {
			entries = append(entries, treeEntry{Type: "directory", OID: oid, Path: d})
		}
	}
	for _, p := range c.paths {
		if !under(p) {
			continue
		}
		f := c.files[p]
		e := treeEntry{Type: "file", OID: f.gitOID, Size: f.size, Path: p}
		if f.lfs {
			e.LFS = &treeLFS{OID: f.sha256, Size: f.size, PointerSize: f.pointer}
		}
		if expand {
			e.LastCommit = &lastCommit{ID: c.sha, Title: c.title, Date: c.time.Format(time.RFC3339)}
			e.SecurityFileStatus = map[string]any{"status": "safe"}
		}
		entries = append(entries, e)
	}
	slices.SortFunc(entries, func(a, b treeEntry) int { return strings.Compare(a.Path, b.Path) })

	page := h.pageSize
	if expand && page > 50 {
		page = 50 // the hub pages expanded listings more finely
	}
	off = min(off, len(entries))
	end := min(off+page, len(entries))
	if end < len(entries) {
		q.Set("cursor", base64.RawURLEncoding.EncodeToString([]byte(strconv.Itoa(end))))
		next := h.base(r) + r.URL.EscapedPath() + "?" + q.Encode()
		w.Header().Set("Link", "<"+next+`>; rel="next"`)
	}
	writeJSON(w, entries[off:end:end])
}

// serveResolve serves /{repo_id}/resolve/{rev}/{path}.
func (h *Hub) serveResolve(w http.ResponseWriter, r *http.Request, segs []string) {
	var id string
	var rest []string
	for _, k := range []int{2, 1} {
		if len(segs) > k+1 && segs[k] == "resolve" {
			cand := strings.Join(segs[:k], "/")
			h.mu.Lock()
			_, exists := h.repos[cand]
			h.mu.Unlock()
			if id == "" || exists {
				id, rest = cand, segs[k+1:]
			}
			if exists {
				break
			}
		}
	}
	if id == "" {
		hubError(w, http.StatusNotFound, "", "Not found")
		return
	}
	if h.fault(w, RouteResolve) {
		return
	}
	repo := h.lookup(w, r, id)
	if repo == nil {
		return
	}
	if repo.gated {
		switch tok := bearer(r); {
		case tok == "":
			hubError(w, http.StatusUnauthorized, "GatedRepo", "Access to model "+repo.id+" is restricted. You must have access to it and be authenticated to access it. Please log in.")
			return
		case tok != repo.token:
			hubError(w, http.StatusForbidden, "GatedRepo", "Access to model "+repo.id+" is restricted and you are not in the authorized list.")
			return
		}
	}
	c, rev, rest := repo.revisionAt(rest)
	if c == nil {
		hubError(w, http.StatusNotFound, "RevisionNotFound", "Invalid rev id: "+rev)
		return
	}
	f, ok := c.files[strings.Join(rest, "/")]
	if !ok {
		hubError(w, http.StatusNotFound, "EntryNotFound", "Entry not found")
		return
	}
	w.Header().Set("X-Repo-Commit", c.sha)
	w.Header().Set("Access-Control-Expose-Headers", "X-Repo-Commit,X-Linked-Etag,X-Linked-Size,ETag,Content-Range")
	if !f.lfs {
		w.Header().Set("ETag", `"`+f.gitOID+`"`)
		h.serveContent(w, r, f, false)
		return
	}
	w.Header().Set("ETag", `"`+f.sha256+`"`)
	w.Header().Set("X-Linked-Etag", `"`+f.sha256+`"`)
	w.Header().Set("X-Linked-Size", strconv.FormatInt(f.size, 10))
	p := "/cdn/repos/" + f.sha256[:2] + "/" + f.sha256[2:4] + "/" + f.sha256
	expires := time.Now().Add(cdnLifetime).Unix()
	v := url.Values{}
	v.Set("response-content-disposition", `inline; filename*=UTF-8''`+url.PathEscape(path.Base(f.path))+`; filename="`+path.Base(f.path)+`";`)
	v.Set("Expires", strconv.FormatInt(expires, 10))
	v.Set("Signature", h.sign(p, expires))
	v.Set("Key-Pair-Id", "HUBTEST")
	http.Redirect(w, r, h.cdnBase(r)+p+"?"+v.Encode(), http.StatusFound)
}

// serveCDN serves /cdn/repos/{aa}/{bb}/{sha256} with a valid signature.
func (h *Hub) serveCDN(w http.ResponseWriter, r *http.Request, segs []string) {
	if h.fault(w, RouteCDN) {
		return
	}
	if r.Header.Get("Authorization") != "" {
		h.stats.cdnAuthed.Add(1)
		if h.cdn != nil {
			cdnError(w, http.StatusBadRequest, "InvalidArgument", "Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter, Signature query string parameter or the Authorization header should be specified")
			return
		}
	}
	if len(segs) != 4 || segs[0] != "repos" {
		cdnError(w, http.StatusNotFound, "NoSuchKey", "The specified key does not exist.")
		return
	}
	q := r.URL.Query()
	expires, err := strconv.ParseInt(q.Get("Expires"), 10, 64)
	p := "/cdn/" + strings.Join(segs, "/")
	if err != nil || time.Now().Unix() > expires || !hmacEqual(q.Get("Signature"), h.sign(p, expires)) {
		cdnError(w, http.StatusForbidden, "AccessDenied", "Access denied")
		return
	}
	sha := segs[3]
	h.mu.Lock()
	content, ok := h.blobs[sha]
	h.mu.Unlock()
	if !ok || segs[1] != sha[:2] || segs[2] != sha[2:4] {
		cdnError(w, http.StatusNotFound, "NoSuchKey", "The specified key does not exist.")
		return
	}
	w.Header().Set("ETag", `"`+sha+`"`)
	if d := q.Get("response-content-disposition"); d != "" {
		w.Header().Set("Content-Disposition", d)
	}
	h.serveContent(w, r, &file{content: content, size: content.Size(), sha256: sha}, true)
}

// serveContent serves a file's bytes with Range support, counting them.
func (h *Hub) serveContent(w http.ResponseWriter, r *http.Request, f *file, cdn bool) {
	h.mu.Lock()
	bad := h.corrupt[f.sha256]
	h.mu.Unlock()
	c := f.content
	if bad {
		c = corrupt{c}
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	cw := &countingWriter{ResponseWriter: w, total: &h.stats.bytes}
	if cdn {
		cw.cdn = &h.stats.cdnBytes
	}
	http.ServeContent(cw, r, "", time.Time{}, io.NewSectionReader(c, 0, f.size))
}

type countingWriter struct {
	http.ResponseWriter
	total, cdn *atomic.Int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.total.Add(int64(n))
	if c.cdn != nil {
		c.cdn.Add(int64(n))
	}
	return n, err
}

func bearer(r *http.Request) string {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return ""
	}
	return tok
}

func hmacEqual(a, b string) bool {
	x, err1 := hex.DecodeString(a)
	y, err2 := hex.DecodeString(b)
	return err1 == nil && err2 == nil && hmac.Equal(x, y)
}

// hubError answers like the hub: X-Error-Code, X-Error-Message and a JSON
// body {"error": msg}.
func hubError(w http.ResponseWriter, status int, code, msg string) {
	if code != "" {
		w.Header().Set("X-Error-Code", code)
	}
	w.Header().Set("X-Error-Message", msg)
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// cdnError answers like an object store.
func cdnError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(status)
	fmt.Fprintf(w, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>%s</Code><Message>%s</Message></Error>\n", code, msg)
}

func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		hubError(w, http.StatusInternalServerError, "", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	_, _ = w.Write(b)
}
