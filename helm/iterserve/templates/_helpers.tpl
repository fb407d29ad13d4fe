{{/* Names and labels. */}}
{{- define "iterserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "iterserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "iterserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "iterserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Stable labels, for selectors and pod templates: a label that changes with the chart's
version would change the cluster spec, and KubeRay would replace the whole cluster. */}}
{{- define "iterserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "iterserve.labels" -}}
{{ include "iterserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "iterserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "iterserve.apiKeysPath" -}}/etc/iterserve/api-keys/api_keys.yaml{{- end }}
{{- define "iterserve.batchConfigPath" -}}/etc/iterserve/batch/service.yaml{{- end }}

{{/*
The application's args: config without host and port (Serve's http_options), with
api_keys_file pointing at the mounted Secret.
*/}}
{{- define "iterserve.appArgs" -}}
{{- $args := omit .Values.config "host" "port" }}
{{- if .Values.apiKeysSecret }}
{{- $_ := set $args "api_keys_file" (include "iterserve.apiKeysPath" .) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Serve's deploy config (ray.serve.schema.ServeDeploySchema), as serveConfigV2. */}}
{{- define "iterserve.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: {{ .Values.config.host | default "0.0.0.0" | quote }}
  port: {{ .Values.config.port | default 8000 | int }}
applications:
  - name: iterserve
    route_prefix: /
    import_path: deploy.app:app_builder
    args:
      {{- include "iterserve.appArgs" . | nindent 6 }}
{{- end }}

{{/* Environment of every Ray container: deploy/server.py's SERVE_ENV_DEFAULTS (a test
checks they match), and Serve's HTTP proxy as the way in (no direct ingress). */}}
{{- define "iterserve.env" -}}
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
{{- end }}

{{- define "iterserve.volumes" -}}
{{- if .Values.apiKeysSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.apiKeysSecret }}
    items:
      - {key: api_keys.yaml, path: api_keys.yaml}
{{- end }}
{{- if .Values.modelVolume.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.claimName }}
    readOnly: true
{{- else if .Values.modelVolume.hostPath }}
- name: models
  hostPath:
    path: {{ .Values.modelVolume.hostPath }}
    type: Directory
{{- end }}
{{- if .batch }}
- name: batch-data
  persistentVolumeClaim:
    claimName: {{ .Values.batchJob.claimName }}
- name: batch-config
  configMap:
    name: {{ include "iterserve.fullname" . }}-batch-config
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
{{- end }}

{{- define "iterserve.volumeMounts" -}}
{{- if .Values.apiKeysSecret }}
- name: api-keys
  mountPath: /etc/iterserve/api-keys
  readOnly: true
{{- end }}
{{- if or .Values.modelVolume.claimName .Values.modelVolume.hostPath }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- if .batch }}
- name: batch-data
  mountPath: {{ .Values.batchJob.mountPath }}
- name: batch-config
  mountPath: /etc/iterserve/batch
  readOnly: true
{{- end }}
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{/*
The Ray cluster: a head (Serve's controller and proxy, the dashboard; num-cpus 0, so no
model replica lands there) and one worker pod per model replica. Takes a dict with the
root context as "root" and "batch" (true in the RayJob: its data volume is mounted).
*/}}
{{- define "iterserve.rayCluster" -}}
{{- $root := .root }}
{{- $ctx := merge (dict "batch" .batch) $root }}
{{- $cfg := $root.Values.config }}
{{- $cpus := $cfg.replica_num_cpus | float64 }}
{{- $gpus := $cfg.replica_num_gpus | default 0 | float64 }}
rayVersion: {{ $root.Values.rayVersion | quote }}
{{- if $root.Values.rayAuthToken }}
authOptions:
  mode: token
{{- end }}
headGroupSpec:
  rayStartParams:
    dashboard-host: "0.0.0.0"
    num-cpus: "0"
  template:
    metadata:
      labels:
        {{- include "iterserve.selectorLabels" $root | nindent 8 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.head.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.head.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-head
          image: {{ include "iterserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          env:
            {{- include "iterserve.env" $root | trim | nindent 12 }}
          ports:
            - {containerPort: 6379, name: gcs-server}
            - {containerPort: 8265, name: dashboard}
            - {containerPort: 10001, name: client}
            - {containerPort: {{ $cfg.port | default 8000 | int }}, name: serve}
          resources:
            requests: {cpu: {{ $root.Values.head.cpu | quote }}, memory: {{ $root.Values.head.memory | quote }}}
            limits: {cpu: {{ $root.Values.head.cpu | quote }}, memory: {{ $root.Values.head.memory | quote }}}
          volumeMounts:
            {{- include "iterserve.volumeMounts" $ctx | trim | nindent 12 }}
      volumes:
        {{- include "iterserve.volumes" $ctx | trim | nindent 8 }}
workerGroupSpecs:
  - groupName: replicas
    replicas: {{ $cfg.num_replicas | default 1 | int }}
    minReplicas: {{ $cfg.num_replicas | default 1 | int }}
    maxReplicas: {{ $cfg.num_replicas | default 1 | int }}
    rayStartParams:
      num-cpus: {{ ceil $cpus | int | quote }}
    template:
      metadata:
        labels:
          {{- include "iterserve.selectorLabels" $root | nindent 10 }}
      spec:
        {{- with $root.Values.imagePullSecrets }}
        imagePullSecrets:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $root.Values.worker.nodeSelector }}
        nodeSelector:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $root.Values.worker.tolerations }}
        tolerations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "iterserve.image" $root }}
            imagePullPolicy: {{ $root.Values.image.pullPolicy }}
            env:
              {{- include "iterserve.env" $root | trim | nindent 14 }}
            ports:
              - {containerPort: {{ $cfg.port | default 8000 | int }}, name: serve}
            resources:
              requests:
                cpu: {{ $cpus | toString | quote }}
                memory: {{ $root.Values.worker.memory | quote }}
                {{- if gt $gpus 0.0 }}
                nvidia.com/gpu: {{ ceil $gpus | int | quote }}
                {{- end }}
              limits:
                cpu: {{ ceil $cpus | int | quote }}
                memory: {{ $root.Values.worker.memory | quote }}
                {{- if gt $gpus 0.0 }}
                nvidia.com/gpu: {{ ceil $gpus | int | quote }}
                {{- end }}
            volumeMounts:
              {{- include "iterserve.volumeMounts" $ctx | trim | nindent 14 }}
        volumes:
          {{- include "iterserve.volumes" $ctx | trim | nindent 10 }}
{{- end }}
