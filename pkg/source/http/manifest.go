package httpsource

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// Limits on manifests, which come from the network.
const (
	// MaxManifestSize is the largest manifest document accepted, in bytes.
	MaxManifestSize = 16 << 20
	// MaxManifestFiles is the most files one manifest may list.
	MaxManifestFiles = 100_000
)

// Manifest is weightd's small JSON description of a model served over plain
// HTTP(S): its name, revision and files, each with its size and sha256.
//
//	{
//	  "name": "org/model",
//	  "revision": "main",
//	  "files": [
//	    {"path": "config.json", "size": 123, "sha256": "<64 lowercase hex>"},
//	    {"path": "model-00001-of-00002.safetensors", "size": 4999000000,
//	     "sha256": "<64 lowercase hex>", "url": "https://bucket.example/…?X-Amz-Signature=…"}
//	  ]
//	}
//
// Parsing is strict (see ParseManifest): exactly these keys, in any order, each
// at most once, matched case-sensitively; "url" is the only optional one.
//
// A file is fetched from its "url" when given, resolved relative to the
// manifest's own URL, else from its path resolved relative to the directory of
// the manifest URL (each path segment escaped; the manifest's query is not
// carried over). A file URL may point at any http or https host, so that
// files can live in an object store under presigned URLs while the manifest
// lives elsewhere; integrity comes from the sha256, not from the host. A
// manifest fetched over https may not send its files over plain http.
//
// The name and revision are the manifest's word, not where its files are
// laid out: Source lays them out under the name of the manifest's URL,
// at a snapshot its revision names only when it is a commit.
type Manifest struct {
	Name     string         `json:"name"`
	Revision string         `json:"revision"`
	Files    []ManifestFile `json:"files"`
}

// ManifestFile is one file of a Manifest.
type ManifestFile struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"` // 64 lowercase hex digits, no "sha256:" prefix
	URL    string `json:"url,omitempty"`
}

// Digest returns the file's digest ("sha256:" + SHA256).
func (f ManifestFile) Digest() digest.Digest {
	return digest.NewDigestFromEncoded(digest.SHA256, f.SHA256)
}

// Model returns the manifest as a content.Model, named as it names itself.
func (m *Manifest) Model() content.Model {
	model := content.Model{Name: m.Name, Revision: m.Revision, Files: make([]content.File, len(m.Files))}
	for i, f := range m.Files {
		model.Files[i] = content.File{Path: f.Path, Descriptor: content.Descriptor{Digest: f.Digest(), Size: f.Size}}
	}
	return model
}

// Layout is the model a manifest is laid out as (see Source): under name,
// the name of the URL it was fetched from (source.ModelName), never as the
// manifest names itself; at the manifest's revision if it is a commit, else
// at the files' own commit-like id, with the revision as a ref to it.
func (m *Manifest) Layout(name string) content.Model {
	model := m.Model()
	model.Name = name
	if !content.IsCommit(m.Revision) {
		model.Ref, model.Revision = m.Revision, FilesRevision(model.Files)
	}
	return model
}

// FilesRevision is a commit-like id of a set of files: the first 40 hex
// digits of the sha256 of each file's path and digest, in path order.
func FilesRevision(files []content.File) string {
	sorted := slices.SortedFunc(slices.Values(files), func(a, b content.File) int { return strings.Compare(a.Path, b.Path) })
	h := sha256.New()
	for _, f := range sorted {
		h.Write([]byte(f.Path))
		h.Write([]byte{0})
		h.Write([]byte(f.Digest))
		h.Write([]byte{'\n'})
	}
	return hex.EncodeToString(h.Sum(nil))[:40]
}

// ReadManifest reads and parses a manifest of at most MaxManifestSize bytes
// from r; a longer document is an error, detected without reading past the
// limit.
func ReadManifest(r io.Reader) (*Manifest, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxManifestSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading manifest: %w", err)
	}
	return ParseManifest(data)
}

// ParseManifest parses and validates a manifest document. It rejects documents
// larger than MaxManifestSize, unknown, duplicated or differently cased keys,
// null values, trailing data, more than MaxManifestFiles files or none, and
// anything content.Model.Validate rejects (bad names and revisions; absolute,
// unclean, "..", NUL-bearing or duplicate paths); sha256 must be 64 lowercase
// hex digits, sizes must not be negative nor sum past math.MaxInt64, two files
// with the same digest must agree on its size, and a "url" must be an http(s)
// URL or a relative reference without user information.
//
// Errors wrap content.ErrInvalid.
func ParseManifest(data []byte) (*Manifest, error) {
	m, err := parseManifest(data)
	if err != nil {
		return nil, fmt.Errorf("parsing manifest: %w", err)
	}
	return m, nil
}

func parseManifest(data []byte) (*Manifest, error) {
	if len(data) > MaxManifestSize {
		return nil, fmt.Errorf("%w: larger than %d bytes", content.ErrInvalid, MaxManifestSize)
	}
	p := jsonParser{dec: json.NewDecoder(bytes.NewReader(data))}
	p.dec.UseNumber()
	var m Manifest
	err := p.object(func(key string) error {
		switch key {
		case "name":
			return p.str(&m.Name)
		case "revision":
			return p.str(&m.Revision)
		case "files":
			return p.array(func() error {
				if len(m.Files) == MaxManifestFiles {
					return fmt.Errorf("more than %d files", MaxManifestFiles)
				}
				f, err := p.file()
				if err != nil {
					return fmt.Errorf("file %d: %w", len(m.Files), err)
				}
				m.Files = append(m.Files, f)
				return nil
			})
		}
		return errUnknownKey
	}, "name", "revision", "files")
	if err == nil {
		err = p.end()
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", content.ErrInvalid, err)
	}
	if err := m.validate(); err != nil {
		return nil, err
	}
	return &m, nil
}

func (m *Manifest) validate() error {
	if len(m.Files) == 0 {
		return fmt.Errorf("%w: no files", content.ErrInvalid)
	}
	var total int64
	sizes := make(map[string]int64, len(m.Files))
	for _, f := range m.Files {
		if err := content.ValidateDigest(f.Digest()); err != nil {
			return fmt.Errorf("file %q: sha256 must be 64 lowercase hex digits: %w", fetch.Truncate(f.Path), err)
		}
		if f.Size < 0 {
			return fmt.Errorf("%w: file %q: negative size %d", content.ErrInvalid, fetch.Truncate(f.Path), f.Size)
		}
		if f.Size > math.MaxInt64-total {
			return fmt.Errorf("%w: total size overflows", content.ErrInvalid)
		}
		total += f.Size
		if size, ok := sizes[f.SHA256]; ok && size != f.Size {
			return fmt.Errorf("%w: file %q: sha256 %s listed with sizes %d and %d", content.ErrInvalid, fetch.Truncate(f.Path), f.SHA256, size, f.Size)
		}
		sizes[f.SHA256] = f.Size
		if f.URL != "" {
			if err := checkFileURL(f.URL); err != nil {
				return fmt.Errorf("file %q: url: %w", fetch.Truncate(f.Path), err)
			}
		}
	}
	return m.Model().Validate()
}

// checkFileURL checks a manifest file's "url" on its own: a relative
// reference, or an absolute http(s) URL; printable ASCII, no user
// information, no fragment.
func checkFileURL(s string) error {
	if len(s) > ref.MaxLength {
		return fmt.Errorf("%w: longer than %d bytes", content.ErrInvalid, ref.MaxLength)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("%w: byte %#02x at offset %d: only printable ASCII without spaces is allowed", content.ErrInvalid, c, i)
		}
	}
	if strings.Contains(s, "#") {
		return fmt.Errorf("%w: fragment not allowed", content.ErrInvalid)
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%w: %q is not a URL", content.ErrInvalid, fetch.Truncate(s))
	}
	if u.User != nil {
		return fmt.Errorf("%w: user information in URLs is not allowed", content.ErrInvalid)
	}
	if u.Scheme != "" || u.Host != "" {
		if err := ref.CheckHTTPURL(u); err != nil {
			return fmt.Errorf("%w: %w", content.ErrInvalid, err)
		}
	}
	return nil
}

// fileURL returns the URL a manifest file is fetched from, given the URL the
// manifest itself came from.
func (f ManifestFile) fileURL(manifestURL *url.URL) (*url.URL, error) {
	href := f.URL
	if href == "" {
		segs := strings.Split(f.Path, "/")
		for i, s := range segs {
			segs[i] = url.PathEscape(s)
		}
		// "./" keeps a first segment with a colon from reading as a scheme.
		href = "./" + strings.Join(segs, "/")
	}
	rel, err := url.Parse(href)
	if err != nil {
		return nil, fmt.Errorf("%w: file %q: url: %v", content.ErrInvalid, fetch.Truncate(f.Path), err)
	}
	u := manifestURL.ResolveReference(rel)
	if err := ref.CheckHTTPURL(u); err != nil {
		return nil, fmt.Errorf("%w: file %q: url: %w", content.ErrInvalid, fetch.Truncate(f.Path), err)
	}
	if manifestURL.Scheme == "https" && u.Scheme != "https" {
		return nil, fmt.Errorf("%w: file %q: url: a manifest fetched over https may not send files over %s", content.ErrInvalid, fetch.Truncate(f.Path), u.Scheme)
	}
	return u, nil
}

var errUnknownKey = errors.New("unknown key")

// jsonParser is a strict, streaming reader of the manifest's JSON, token by
// token: keys are matched exactly, each at most once, values must have their
// type (null is not a string), and nothing may follow the document.
type jsonParser struct {
	dec *json.Decoder
}

func (p *jsonParser) delim(want json.Delim) error {
	tok, err := p.token()
	if err != nil {
		return err
	}
	if d, ok := tok.(json.Delim); !ok || d != want {
		return fmt.Errorf("want %q, got %s", want, describe(tok))
	}
	return nil
}

// token reads the next token; the document ending early is
// io.ErrUnexpectedEOF.
func (p *jsonParser) token() (json.Token, error) {
	tok, err := p.dec.Token()
	if errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return tok, err
}

// object reads an object, calling field for each key with the decoder
// positioned at its value. Every key in required must be present.
func (p *jsonParser) object(field func(key string) error, required ...string) error {
	if err := p.delim('{'); err != nil {
		return err
	}
	seen := make(map[string]bool, len(required)+1)
	for p.dec.More() {
		tok, err := p.token()
		if err != nil {
			return err
		}
		key, ok := tok.(string)
		if !ok {
			return fmt.Errorf("want a key, got %s", describe(tok))
		}
		if seen[key] {
			return fmt.Errorf("duplicate key %q", fetch.Truncate(key))
		}
		seen[key] = true
		if err := field(key); err != nil {
			if errors.Is(err, errUnknownKey) {
				return fmt.Errorf("unknown key %q", fetch.Truncate(key))
			}
			return fmt.Errorf("%s: %w", key, err)
		}
	}
	if err := p.delim('}'); err != nil {
		return err
	}
	for _, k := range required {
		if !seen[k] {
			return fmt.Errorf("missing key %q", k)
		}
	}
	return nil
}

func (p *jsonParser) array(elem func() error) error {
	if err := p.delim('['); err != nil {
		return err
	}
	for p.dec.More() {
		if err := elem(); err != nil {
			return err
		}
	}
	return p.delim(']')
}

// str reads a string value.
func (p *jsonParser) str(s *string) error {
	tok, err := p.token()
	if err != nil {
		return err
	}
	v, ok := tok.(string)
	if !ok {
		return fmt.Errorf("want a string, got %s", describe(tok))
	}
	*s = v
	return nil
}

// int reads an integer value: digits only, no fraction or exponent, within
// int64.
func (p *jsonParser) int(n *int64) error {
	tok, err := p.token()
	if err != nil {
		return err
	}
	num, ok := tok.(json.Number)
	if !ok {
		return fmt.Errorf("want an integer, got %s", describe(tok))
	}
	v, err := strconv.ParseInt(string(num), 10, 64)
	if err != nil {
		return fmt.Errorf("want an integer, got %s", fetch.Truncate(string(num)))
	}
	*n = v
	return nil
}

func (p *jsonParser) file() (ManifestFile, error) {
	var f ManifestFile
	err := p.object(func(key string) error {
		switch key {
		case "path":
			return p.str(&f.Path)
		case "size":
			return p.int(&f.Size)
		case "sha256":
			return p.str(&f.SHA256)
		case "url":
			return p.str(&f.URL)
		}
		return errUnknownKey
	}, "path", "size", "sha256")
	return f, err
}

// end checks that nothing but white space follows the document.
func (p *jsonParser) end() error {
	if _, err := p.dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("trailing data after the manifest")
	}
	return nil
}

func describe(tok json.Token) string {
	switch t := tok.(type) {
	case json.Delim:
		return fmt.Sprintf("%q", t)
	case string:
		return "a string"
	case json.Number:
		return "a number"
	case bool:
		return "a boolean"
	case nil:
		return "null"
	default:
		return fmt.Sprintf("%T", t)
	}
}
